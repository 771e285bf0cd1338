"""The training loop and its policy: one happy path (step, log, evaluate, save) with the guards as named calls.

    iteration_boundary   every rank agrees on stop signals, the clock and this batch's token ids (guards.agree)
    train_step           forward/backward over the pipeline, gradient reduction, optimizer step
    after_step           counters, the console line and metrics.jsonl
    NonFiniteGuard       too many non-finite iterations in a row stop the run (exit 4)
    evaluate_and_save    validation at eval_interval, checkpoints at save_interval / exit_interval / the end
    report_stragglers    every logging.straggler_interval iterations, the slowest and fastest rank (straggler.py)

`run_training` builds the run (training/run.py), resumes it if asked, trains, and maps every way a run ends to
its exit code (operations/guards.py); a collective that times out or fails ends it with a hang report (exit 5,
operations/watchdog.py's HangGuard, which also lowers the timeouts after the first iteration and watches for
ranks that stop making progress).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable

import torch

from checkpoint import CheckpointError, save_checkpoint
from config.schema import Config
from data.microbatch import Microbatch
from operations.faults import FaultSpec
from operations.guards import (
    EXIT_DIVERGED,
    EXIT_ERROR,
    EXIT_INPUT_ERROR,
    EXIT_OK,
    EXIT_PREEMPTED,
    Agreement,
    NonFiniteGuard,
    TrainingStopped,
    agree,
    bad_token_message,
    find_bad_token,
    weights_are_finite,
)
from operations.loader_workers import MicrobatchStream
from operations.log import get_logger
from operations.preemption import PreemptionHandler, job_start_time
from operations.startup import Dataset, DistEnv, data_iterator
from operations.watchdog import HangGuard
from parallel.comm import CollectiveError
from parallel.layout import Layout
from parallel.pipeline.forward import evaluate, take_microbatches
from training.logging import IntervalStats, MetricsWriteError, format_train_line, peak_tflops
from training.run import Run, build_run, resume_if_asked
from training.train_step import StepResult, train_step

# Figures an extra evaluation (the zero-shot tasks of eval.*) adds to the validation record; {} when not due.
ExtraEvaluation = Callable[[Run], dict[str, float]]


def relaxed(run: Run) -> contextlib.AbstractContextManager[None]:
    """Around checkpoint work: the watchdog allows the start-up timeout (saves never trip the training one)."""
    return run.guards.hang_guard.relaxed() if run.guards.hang_guard is not None else contextlib.nullcontext()


def save(run: Run) -> None:
    """Checkpoint the current iteration (sync, or copied aside and written in the background with async_save);
    the checkpointer logs its size and the time the loop was blocked. Never from non-finite weights."""
    if run.checkpointer is None or run.loop.last_saved == run.progress.iteration:
        return
    with relaxed(run), run.state.comm.region("checkpoint", run.progress.iteration):
        _save(run)


def _save(run: Run) -> None:
    ctx = run.ctx
    ctx.optimizer.finish_param_gather()  # overlap_param_gather: the params are complete before they are read
    if not weights_are_finite(ctx.chunks, run.state, run.env.device):
        raise TrainingStopped(
            f"training diverged: the weights after iteration {run.progress.iteration} are not "
            f"finite, so no checkpoint was written; the last one on disk is iteration "
            f"{run.loop.last_saved}: lower optim.lr and resume from it",
            EXIT_DIVERGED,
        )
    save_checkpoint(
        run.checkpoint_root,
        run.checkpoint_parts(),
        run.progress,
        run.config.to_dict(),
        keep_last=run.config.checkpoint.keep_last,
        checkpointer=run.checkpointer,
    )
    run.loop.last_saved = run.progress.iteration


def check_tokens(
    run: Run,
    microbatches: list[Microbatch],
    dataset: Dataset | None,
    first_sample: int,
    split: str,
    signal_number: int = 0,
    time_up: bool = False,
) -> Agreement:
    """The per-iteration agreement (operations.guards.agree): stop signals, the clock and this batch's token
    ids against model.vocab_size. A bad id anywhere stops every rank; the lowest rank that holds it says
    which document of which dataset it came from."""
    vocab_size, state, mbs = run.vocab_size, run.state, run.config.train.micro_batch_size
    found = find_bad_token(microbatches, vocab_size)
    verdict = agree(state, run.env.device, signal_number, time_up, found is not None)
    if verdict.bad_token_rank >= 0:
        message = ""
        if found is not None and dataset is not None:
            message = bad_token_message(
                found, dataset, first_sample, mbs, state.dp_rank, state.dp_size, vocab_size, split
            )
        raise TrainingStopped(message, EXIT_INPUT_ERROR, reporting_rank=verdict.bad_token_rank)
    return verdict


def run_evaluation(run: Run, extra: dict[str, float] | None = None) -> None:
    """Validation loss and perplexity on the first eval_iters global batches of the valid split, written with
    the `extra` figures (the zero-shot tasks of eval.*) as one record."""
    train_cfg, state = run.config.train, run.state
    record: dict[str, float] = {"iteration": run.progress.iteration, **(extra or {})}
    if run.datasets[1] is not None and train_cfg.eval_iters > 0:
        # A fresh in-process iterator each time: every evaluation scores the same batches, so values compare.
        valid_iter = data_iterator(
            run.config, run.datasets[1], 0, state.dp_rank, state.dp_size, run.eod_id, num_workers=0
        )

        def check(microbatches: list[Microbatch], batch: int) -> None:
            check_tokens(run, microbatches, run.datasets[1], batch * train_cfg.global_batch_size, "valid")

        with state.comm.region("eval", run.progress.iteration):
            val_loss = evaluate(run.ctx, valid_iter, train_cfg.eval_iters, check)
        val_ppl = float(torch.exp(torch.tensor(min(val_loss, 20.0))))
        run.logger.info(f"validation at iteration {run.progress.iteration}: loss {val_loss:.4f} | ppl {val_ppl:.3f}")
        record.update(val_loss=val_loss, val_ppl=val_ppl)
    if len(record) > 1:
        run.metrics.write(record)


def iteration_boundary(run: Run, microbatches: list[Microbatch], job_start: float) -> bool:
    """Before each step, one agreement of all ranks: a bad token id stops the run (exit 2); a stop signal
    saves the last finished iteration and stops it (exit 3); exit_duration_mins (counted from the job's
    start) saves and ends it (exit 0, returns True)."""
    train_cfg = run.config.train
    received = run.guards.preemption.received if run.guards.preemption is not None else None
    over = bool(train_cfg.exit_duration_mins) and (time.time() - job_start) / 60.0 >= train_cfg.exit_duration_mins
    verdict = check_tokens(
        run, microbatches, run.datasets[0], run.progress.consumed_samples, "train", int(received or 0), over
    )
    if verdict.signal_number:
        save(run)
        name = signal.Signals(verdict.signal_number).name
        raise TrainingStopped(
            f"stopped by {name} after iteration {run.progress.iteration} with a checkpoint of it "
            f"under {run.checkpoint_root}: run again with checkpoint.load=true to continue",
            EXIT_PREEMPTED,
        )
    if verdict.time_up:
        save(run)
        run.logger.info(
            f"train.exit_duration_mins={train_cfg.exit_duration_mins} reached after iteration "
            f"{run.progress.iteration} (counted from the job's start): checkpoint saved"
        )
    return verdict.time_up


def after_step(run: Run, stats: IntervalStats, result: StepResult, lr: float, seconds: float) -> None:
    """Counters, the console line and metrics.jsonl for one finished iteration."""
    cfg, progress = run.config, run.progress
    progress.iteration += 1
    progress.consumed_samples += cfg.train.global_batch_size
    progress.skipped_iters += int(result.skipped)
    stats.add(result, lr, seconds)
    if progress.iteration % cfg.logging.log_interval == 0:
        record = stats.flush(progress)
        run.logger.info(format_train_line(record, cfg.train.train_iters))
        run.metrics.write(record)
    report_stragglers(run)


def report_stragglers(run: Run) -> None:
    """Every logging.straggler_interval iterations (all ranks, one small all-gather): the slowest and fastest
    rank on the console and in metrics.jsonl / TensorBoard, and a warning for a persistent straggler."""
    summary = run.guards.straggler.report(run.progress.iteration) if run.guards.straggler is not None else None
    if summary is None:
        return
    run.logger.info(summary.line)
    for warning in summary.warnings:
        run.logger.warning(warning)
    run.metrics.write(summary.record)


def write_start_record(run: Run) -> None:
    """metrics.jsonl's record at the start of a run and of each resume: the iteration it starts from and the
    thread choice with its reason (the count decides a run's last bits, so a resume that differs from the run it
    continues shows why)."""
    if run.env.threads is not None:
        run.metrics.write({"iteration": run.progress.iteration, **run.env.threads.record()})


def train(run: Run, extra_evaluation: ExtraEvaluation | None = None) -> None:
    """The training loop: step, log, evaluate, save, until train_iters or an exit condition.
    `extra_evaluation(run)` (the zero-shot tasks of eval.*) runs after every iteration and returns the
    figures to log with the validation loss, or nothing when it is not due."""
    state = run.state
    train_iter = data_iterator(
        run.config, run.datasets[0], run.progress.consumed_samples, state.dp_rank, state.dp_size, run.eod_id
    )
    try:
        train_from(run, train_iter, extra_evaluation)
    finally:
        # Every way out, an exception included: the loader's workers ignore SIGTERM (they must outlive scancel's
        # until the trainer has saved), so at interpreter exit multiprocessing would wait for them forever.
        train_iter.close()


def train_from(run: Run, train_iter: MicrobatchStream, extra_evaluation: ExtraEvaluation | None = None) -> None:
    """`train`'s loop over the batches of `train_iter`."""
    cfg, train_cfg, state = run.config, run.config.train, run.state
    job_start = job_start_time()
    write_start_record(run)
    if run.progress.iteration == 0:
        run_evaluation(run)
    run.comm_counter.reset()  # count the first training iteration only, not the evaluation before it
    iteration_one = run.progress.iteration + 1
    stats = IntervalStats(
        run.shape.flops,
        run.shape.tokens_per_iteration,
        run.env.world_size,
        run.env.device.type,
        peak_tflops(cfg.logging.peak_tflops, run.env.device.type, cfg.train.precision),
    )
    nonfinite = NonFiniteGuard(train_cfg.max_nonfinite_iters, cfg.optim.min_loss_scale, train_cfg.precision == "fp16")
    comm = state.comm  # labels what each collective below belongs to in the rank's record (parallel/comm.py)
    guard, straggler = run.guards.hang_guard, run.guards.straggler
    while run.progress.iteration < train_cfg.train_iters:
        iteration = run.progress.iteration + 1
        if guard is not None:
            guard.iteration_started(iteration)
        if straggler is not None:
            straggler.begin()
        microbatches = take_microbatches(train_iter, run.ctx.num_microbatches)
        with comm.region("boundary", iteration):
            if iteration_boundary(run, microbatches, job_start):
                break
        lr = run.lr_schedule.lr(run.progress.iteration)
        started = time.perf_counter()
        with comm.region("train", iteration):
            if run.guards.fault is not None:
                run.guards.fault.raise_if_due(run.env.rank, iteration)  # PTDP_INJECT_FAULT kind=raise
            result = train_step(
                run.ctx, microbatches, lr, before_update=run.checkpointer.before_update if run.checkpointer else None
            )
        if run.env.device.type == "cuda":
            torch.cuda.synchronize()
        if straggler is not None:
            straggler.end()
        after_step(run, stats, result, lr, time.perf_counter() - started)
        if run.checkpointer is not None:
            run.checkpointer.poll()  # report a finished background save promptly
        if run.progress.iteration == iteration_one:
            first_iteration_notes(run, started)
            if guard is not None:
                guard.steady()  # start-up is over: the training timeout from here on
        nonfinite.check(result, run.progress.iteration)
        if evaluate_and_save(run, extra_evaluation):
            break
    finish(run)


def first_iteration_notes(run: Run, started: float) -> None:
    """After the first iteration of this process: how long compiling took (train.compile) and, with tp > 1,
    the tensor-parallel collectives that iteration ran."""
    train_cfg, state, iteration = run.config.train, run.state, run.progress.iteration
    if train_cfg.compile:
        run.logger.info(
            f"train.compile: iteration {iteration} took {time.perf_counter() - started:.1f} s, "
            f"compiling the transformer layers included (regional, once per layer code)"
        )
    if state.tp_size > 1:
        layers = sum(len(chunk.layers) for chunk in run.ctx.chunks)
        run.logger.info(
            f"tensor-parallel collectives of iteration {iteration} on rank {state.rank}:\n"
            + run.comm_counter.summary(layers, run.ctx.num_microbatches)
        )


def evaluate_and_save(run: Run, extra_evaluation: ExtraEvaluation | None = None) -> bool:
    """After an iteration: validation at eval_interval and at the end (with the zero-shot figures when they are
    due); a checkpoint at save_interval, at the end and at exit_interval. Returns True when exit_interval ends
    the run here."""
    train_cfg, progress = run.config.train, run.progress
    with run.state.comm.region("eval", progress.iteration):
        extra = extra_evaluation(run) if extra_evaluation is not None else {}
    if progress.iteration % train_cfg.eval_interval == 0 or progress.iteration == train_cfg.train_iters:
        run_evaluation(run, extra)
    elif extra:
        run.metrics.write({"iteration": progress.iteration, **extra})
    stop = bool(train_cfg.exit_interval and progress.iteration % train_cfg.exit_interval == 0)
    interval = run.config.checkpoint.save_interval
    if stop or progress.iteration == train_cfg.train_iters or (interval and progress.iteration % interval == 0):
        save(run)
    if stop:
        run.logger.info(f"exit condition reached after iteration {progress.iteration}")
    return stop


def finish(run: Run) -> None:
    """The end of a run that was not stopped: the last save completes, metrics are closed, ranks meet."""
    if run.checkpointer is not None:
        with relaxed(run):
            run.checkpointer.wait()  # an async save in flight completes (and reports) before the run ends
    run.metrics.close()
    if run.state.is_distributed:
        run.state.comm.barrier()
    run.logger.info(
        f"done. metrics: {os.path.join(run.config.run.dir, 'metrics.jsonl')} | TensorBoard: "
        f"{run.metrics.tensorboard_dir} | checkpoints: {run.checkpoint_root}"
    )


def run_training(
    config: Config,
    env: DistEnv,
    layout: Layout,
    preemption: PreemptionHandler,
    make_extra_evaluation: Callable[[Run], ExtraEvaluation] | None = None,
    fault: FaultSpec | None = None,
) -> int:
    """Build, resume, train; returns the exit code (operations.guards). `make_extra_evaluation(run)` builds the
    run's extra evaluation once the run exists (pretrain_gpt.py passes the zero-shot tasks of eval.*); `fault` is
    PTDP_INJECT_FAULT's test hook (operations/faults.py). A collective that times out or fails, from start-up on,
    ends the run with this rank's hang report (exit 5)."""
    par = config.parallel
    guard = HangGuard(par.init_timeout_s, par.train_timeout_s, config.run.dir, get_logger(env.rank))
    try:
        return _build_and_train(config, env, layout, preemption, make_extra_evaluation, fault, guard)
    except CollectiveError as err:
        return guard.collective_failed(err)
    finally:
        guard.stop()


def _build_and_train(
    config: Config,
    env: DistEnv,
    layout: Layout,
    preemption: PreemptionHandler,
    make_extra_evaluation: Callable[[Run], ExtraEvaluation] | None,
    fault: FaultSpec | None,
    guard: HangGuard,
) -> int:
    try:  # bad input found while building (data files, tokenizer, checkpoint): one line, exit 2
        run = build_run(config, env, layout, guard, fault, preemption)
        extra_evaluation = make_extra_evaluation(run) if make_extra_evaluation is not None else None
        resume_if_asked(run)
    except (ValueError, OSError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    try:
        try:
            train(run, extra_evaluation)
        except TrainingStopped:
            if run.checkpointer is not None:
                with relaxed(run):
                    run.checkpointer.wait()  # the stop's checkpoint, written in the background, completes first
            raise
    except (CheckpointError, MetricsWriteError) as err:  # a failed write: one line; the last checkpoint stays
        run.metrics.close()
        print(f"error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except TrainingStopped as stop:
        run.metrics.close()
        if env.rank == stop.reporting_rank:
            if stop.exit_code == EXIT_PREEMPTED:
                run.logger.info(str(stop))
            else:
                print(f"error: {stop}", file=sys.stderr, flush=True)
        return stop.exit_code
    except CollectiveError:
        run.metrics.close()  # what was logged stays readable; the hang report follows (run_training)
        raise
    return EXIT_OK
