"""Pretrain a GPT with tensor, pipeline and data parallelism (PTD-P).

    python pretrain_gpt.py [--config configs/gpt_tiny.yaml] [section.key=value ...]
    torchrun --nproc-per-node 8 pretrain_gpt.py parallel.tp_size=2 parallel.pp_size=2 ...

Reads the config, joins torch.distributed, builds the parallel state, data, model chunks, optimizer and
checkpointer, then runs the training loop. Everything the run writes goes under run.dir.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import yaml

from config.schema import Config, ConfigError, load_config
from data.tokenizers import build_tokenizer
from parallel.data_parallel import DataParallel
from parallel.layout import Layout, layout_from_config
from parallel.model_builder import build_model_chunks, count_parameters
from parallel.random import RNGTracker, make_checkpoint_fn
from parallel.state import ParallelState
from parallel.tensor_parallel import CommCounter
from training.checkpoint.resume import ResumePlan, load_into_run, plan_resume
from training.checkpointing import Checkpointer, CheckpointError, TrainingProgress, save_checkpoint
from training.flops import flops_per_iteration
from training.guards import (
    EXIT_DIVERGED,
    EXIT_ERROR,
    EXIT_INPUT_ERROR,
    EXIT_INTERRUPTED,
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
from training.logging import IntervalStats, MetricsWriter, format_train_line, get_logger
from training.lr_schedule import LRSchedule
from training.optimizer import DistributedOptimizer, Optimizer, build_optimizer
from training.preemption import Interrupted, PreemptionHandler, job_start_time
from training.run_lock import RunLock, take_run_lock
from training.setup import (
    REPO_ROOT,
    DatasetSplits,
    DistEnv,
    barrier,
    build_datasets,
    check_devices,
    check_vocab_size,
    data_iterator,
    init_distributed,
    log_kernel_choices,
    param_dtype,
    resolve_sample_data,
)
from training.train_step import StepContext, StepResult, evaluate, take_microbatches, train_step

DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs", "gpt_tiny.yaml")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config (default: configs/gpt_tiny.yaml)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.train_iters=50")
    return parser.parse_args(argv)


@dataclass
class Run:
    """Everything the loop touches, built once by `build_run`."""

    config: Config
    env: DistEnv
    layout: Layout
    state: ParallelState
    ctx: StepContext
    lr_schedule: LRSchedule
    rng_tracker: RNGTracker
    comm_counter: CommCounter
    datasets: DatasetSplits  # train, valid, test (valid/test may be None)
    eod_id: int
    progress: TrainingProgress
    metrics: MetricsWriter
    logger: logging.Logger
    checkpoint_root: str
    flops_per_iter: float
    resume_plan: ResumePlan | None = None  # the checkpoint to start from; None: start fresh
    checkpointer: Checkpointer | None = None  # None with checkpoint.save=false
    preemption: PreemptionHandler | None = None
    last_saved: int = -1  # iteration of the checkpoint this run last wrote or loaded


def prepare_data(config: Config, env: DistEnv, logger: logging.Logger) -> tuple[int, DatasetSplits, ResumePlan | None]:
    """Tokenizer (which fills in model.vocab_size), the checkpoint to start from (checked against this config
    and verified before anything is written) and datasets; then the resolved config is saved.
    Returns the end-of-document id, the datasets and the resume plan."""
    resolve_sample_data(config, env, logger)
    data = config.data
    tokenizer = build_tokenizer(
        data.tokenizer_type,
        vocab_file=data.vocab_file,
        merge_file=data.merge_file,
        tokenizer_model=data.tokenizer_model,
    )
    if config.model.vocab_size is None:
        config.model.vocab_size = tokenizer.vocab_size
    check_vocab_size(config.model.vocab_size, tokenizer.vocab_size, data)
    resume_plan = plan_resume(config, os.path.join(config.run.dir, "checkpoints"), logger.info, env.rank == 0)
    datasets = build_datasets(config, env, config.train.global_batch_size)
    if env.rank == 0:  # written once the inputs have proved readable: a failed start leaves no run folder
        os.makedirs(config.run.dir, exist_ok=True)
        with open(os.path.join(config.run.dir, "config.yaml"), "w", encoding="utf-8") as handle:
            yaml.safe_dump(config.to_dict(), handle, sort_keys=False)
        logger.info("resolved config:\n" + yaml.safe_dump(config.to_dict(), sort_keys=False).rstrip())
    return tokenizer.eod, datasets, resume_plan


def build_optimizer_and_schedule(
    config: Config, chunks: list, state: ParallelState
) -> tuple[DataParallel, Optimizer | DistributedOptimizer, LRSchedule]:
    """Gradient buffers (data parallelism), the (distributed) optimizer and the LR schedule."""
    par, train_cfg, optim = config.parallel, config.train, config.optim
    ddp = DataParallel(
        chunks,
        state,
        bucket_size_mb=par.grad_bucket_size_mb,
        distributed_optimizer=par.distributed_optimizer,
        grad_dtype=torch.float32,
    )
    optimizer = build_optimizer(
        chunks,
        ddp,
        state,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=(optim.adam_beta1, optim.adam_beta2),
        eps=optim.adam_eps,
        clip_grad=train_cfg.clip_grad,
        precision=train_cfg.precision,
        loss_scale_cfg=dict(
            initial=optim.initial_loss_scale,
            min=optim.min_loss_scale,
            window=optim.loss_scale_window,
            hysteresis=optim.hysteresis,
        ),
    )
    lr_schedule = LRSchedule(
        optim.lr,
        optim.min_lr,
        optim.lr_warmup_iters,
        optim.lr_decay_iters or train_cfg.train_iters,
        optim.lr_decay_style,
    )
    return ddp, optimizer, lr_schedule


def build_run(config: Config, env: DistEnv, layout: Layout) -> Run:
    """Parallel state, data, model chunks, optimizer, schedule; resume from the latest checkpoint if asked."""
    par, train_cfg, model_cfg = config.parallel, config.train, config.model
    logger = get_logger(env.rank)
    state = ParallelState.from_layout(layout)
    logger.info(f"layout: {layout.describe()}; {state.describe()}; device {env.device}")
    eod_id, datasets, resume_plan = prepare_data(config, env, logger)
    dtype = param_dtype(train_cfg.precision)
    rng_tracker = RNGTracker.seeded(train_cfg.seed, state.tp_rank, state.pp_rank, env.device)
    comm_counter = CommCounter()
    chunks = build_model_chunks(
        model_cfg,
        state,
        train_cfg.seed,
        env.device,
        dtype,
        layout.sequence_parallel,
        rng_tracker=rng_tracker,
        comm_counter=comm_counter,
        checkpoint_fn=make_checkpoint_fn(rng_tracker),
        recompute=train_cfg.recompute,
        recompute_method=train_cfg.recompute_method,
        recompute_num_layers=train_cfg.recompute_num_layers,
        compile_layers=train_cfg.compile,
        compile_backend=train_cfg.compile_backend,
    )
    log_kernel_choices(chunks, model_cfg, train_cfg.micro_batch_size, state.tp_size, env.device, dtype, logger)
    ddp, optimizer, lr_schedule = build_optimizer_and_schedule(config, chunks, state)
    seq_local = model_cfg.seq_length // (layout.tp_size if layout.sequence_parallel else 1)
    ctx = StepContext(
        chunks=chunks,
        state=state,
        layout=layout,
        ddp=ddp,
        optimizer=optimizer,
        activation_shape=(seq_local, train_cfg.micro_batch_size, model_cfg.hidden_size),
        activation_dtype=dtype,
        device=env.device,
        scatter_gather=par.scatter_gather and not layout.sequence_parallel,
        overlap_p2p_comm=par.overlap_p2p_comm,
    )
    params = _all_reduce_int(count_parameters(chunks, state), state.model_parallel_group, state)
    logger.info(
        f"model: {params / 1e6:.2f} M parameters, padded vocabulary {model_cfg.padded_vocab_size(state.tp_size)}"
        f", {layout.num_microbatches} micro-batches of {train_cfg.micro_batch_size} per dp rank, {dtype}; "
        f"optimizer state {optimizer.state_bytes() / 2**20:.1f} MiB on rank {state.rank}"
    )
    flops = flops_per_iteration(
        train_cfg.global_batch_size,
        model_cfg.seq_length,
        model_cfg.num_layers,
        model_cfg.hidden_size,
        model_cfg.padded_vocab_size(state.tp_size),
        full_recompute=train_cfg.recompute == "full",
    )
    return Run(
        config=config,
        env=env,
        layout=layout,
        state=state,
        ctx=ctx,
        lr_schedule=lr_schedule,
        rng_tracker=rng_tracker,
        comm_counter=comm_counter,
        datasets=datasets,
        eod_id=eod_id,
        progress=TrainingProgress(),
        metrics=MetricsWriter(config.run.dir, env.rank == 0, config.logging.tensorboard),
        logger=logger,
        checkpoint_root=os.path.join(config.run.dir, "checkpoints"),
        flops_per_iter=flops,
        resume_plan=resume_plan,
        checkpointer=Checkpointer(config.checkpoint.async_save, logger.info) if config.checkpoint.save else None,
    )


def _all_reduce_int(value: int, group: dist.ProcessGroup | None, state: ParallelState) -> int:
    if not state.is_distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, group=group)
    return int(tensor.item())


def resume_if_asked(run: Run) -> None:
    """Load the checkpoint planned at start-up (checkpoint.load: true, a checkpoints folder or one
    iter_XXXXXXX; weights only with checkpoint.finetune / checkpoint.load_optimizer=false), at any layout."""
    if run.resume_plan is None:  # iteration 0: an old metrics.jsonl here belongs to an earlier attempt
        moved = run.metrics.set_aside()
        if moved:
            run.logger.info(f"starting at iteration 0: the previous {run.metrics.path} was moved to {moved}")
        return
    ctx = run.ctx
    loaded = load_into_run(
        run.resume_plan,
        run.config,
        run.state,
        ctx.chunks,
        ctx.optimizer,
        run.lr_schedule,
        run.rng_tracker,
        run.logger.info,
    )
    run.progress = TrainingProgress(*loaded)
    run.last_saved = run.progress.iteration
    run.metrics.truncate_after(run.progress.iteration)
    run.logger.info(
        f"{'resumed from' if run.progress.iteration else 'starting at'} iteration "
        f"{run.progress.iteration} ({run.progress.consumed_samples} samples consumed)"
    )


def save(run: Run) -> None:
    """Checkpoint the current iteration (sync, or copied aside and written in the background with async_save);
    the checkpointer logs its size and the time the loop was blocked. Never from non-finite weights."""
    if run.checkpointer is None or run.last_saved == run.progress.iteration:
        return
    ctx = run.ctx
    if not weights_are_finite(ctx.chunks, run.state, run.env.device):
        raise TrainingStopped(
            f"training diverged: the weights after iteration {run.progress.iteration} are not "
            f"finite, so no checkpoint was written; the last one on disk is iteration "
            f"{run.last_saved}: lower optim.lr and resume from it",
            EXIT_DIVERGED,
        )
    save_checkpoint(
        run.checkpoint_root,
        run.state,
        run.progress,
        ctx.chunks,
        ctx.optimizer,
        run.lr_schedule,
        run.rng_tracker.state_dict(),
        run.config.to_dict(),
        run.config.parallel.distributed_optimizer,
        checkpointer=run.checkpointer,
        keep_last=run.config.checkpoint.keep_last,
    )
    run.last_saved = run.progress.iteration


def check_tokens(
    run: Run,
    microbatches: list,
    dataset: Any,
    first_sample: int,
    split: str,
    signal_number: int = 0,
    time_up: bool = False,
) -> Agreement:
    """The per-iteration agreement (training.guards.agree): stop signals, the clock and this batch's token
    ids against model.vocab_size. A bad id anywhere stops every rank; the lowest rank that holds it says
    which document of which dataset it came from."""
    vocab_size, state, mbs = run.config.model.vocab_size, run.state, run.config.train.micro_batch_size
    found = find_bad_token(microbatches, vocab_size)
    verdict = agree(state, run.env.device, signal_number, time_up, found is not None)
    if verdict.bad_token_rank >= 0:
        message = ""
        if found is not None:  # this dp rank's samples start dp_rank * mbs into each global batch
            message = bad_token_message(
                found, dataset, first_sample + state.dp_rank * mbs, mbs, state.dp_size, vocab_size, split
            )
        raise TrainingStopped(message, EXIT_INPUT_ERROR, reporting_rank=verdict.bad_token_rank)
    return verdict


def run_evaluation(run: Run) -> None:
    """Validation loss and perplexity on the first eval_iters global batches of the valid split."""
    train_cfg, state = run.config.train, run.state
    if run.datasets[1] is None or train_cfg.eval_iters == 0:
        return
    # A fresh in-process iterator each time: every evaluation scores the same batches, so values compare.
    valid_iter = data_iterator(run.config, run.datasets[1], 0, state.dp_rank, state.dp_size, run.eod_id, num_workers=0)

    def check(microbatches: list, batch: int) -> None:
        check_tokens(run, microbatches, run.datasets[1], batch * train_cfg.global_batch_size, "valid")

    val_loss = evaluate(run.ctx, valid_iter, train_cfg.eval_iters, check)
    val_ppl = float(torch.exp(torch.tensor(min(val_loss, 20.0))))
    run.logger.info(f"validation at iteration {run.progress.iteration}: loss {val_loss:.4f} | ppl {val_ppl:.3f}")
    run.metrics.write({"iteration": run.progress.iteration, "val_loss": val_loss, "val_ppl": val_ppl})


def iteration_boundary(run: Run, microbatches: list, job_start: float) -> bool:
    """Before each step, one agreement of all ranks: a bad token id stops the run (exit 2); a stop signal
    saves the last finished iteration and stops it (exit 3); exit_duration_mins (counted from the job's
    start) saves and ends it (exit 0, returns True)."""
    train_cfg = run.config.train
    received = run.preemption.received if run.preemption is not None else None
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


def train(run: Run) -> None:
    """The training loop: step, log, evaluate, save, until train_iters or an exit condition."""
    cfg, train_cfg, state = run.config, run.config.train, run.state
    job_start = job_start_time()
    train_iter = data_iterator(
        cfg, run.datasets[0], run.progress.consumed_samples, state.dp_rank, state.dp_size, run.eod_id
    )
    if run.progress.iteration == 0:
        run_evaluation(run)
    run.comm_counter.reset()  # count the first training iteration only, not the evaluation before it
    iteration_one = run.progress.iteration + 1
    stats = IntervalStats(
        run.flops_per_iter, cfg.train.global_batch_size * cfg.model.seq_length, run.env.world_size, run.env.device.type
    )
    nonfinite = NonFiniteGuard(train_cfg.max_nonfinite_iters, cfg.optim.min_loss_scale, train_cfg.precision == "fp16")
    while run.progress.iteration < train_cfg.train_iters:
        microbatches = take_microbatches(train_iter, run.ctx.num_microbatches)
        if iteration_boundary(run, microbatches, job_start):
            break
        lr = run.lr_schedule.lr(run.progress.iteration)
        started = time.perf_counter()
        result = train_step(
            run.ctx, microbatches, lr, before_update=run.checkpointer.before_update if run.checkpointer else None
        )
        if run.env.device.type == "cuda":
            torch.cuda.synchronize()
        after_step(run, stats, result, lr, time.perf_counter() - started)
        progress = run.progress
        if run.checkpointer is not None:
            run.checkpointer.poll()  # report a finished background save promptly
        if run.progress.iteration == iteration_one and train_cfg.compile:
            run.logger.info(
                f"train.compile: iteration {iteration_one} took {time.perf_counter() - started:.1f} s, "
                f"compiling the transformer layers included (regional, once per layer code)"
            )
        if progress.iteration == iteration_one and state.tp_size > 1:
            layers = sum(len(chunk.layers) for chunk in run.ctx.chunks)
            run.logger.info(
                f"tensor-parallel collectives of iteration {iteration_one} on rank {state.rank}:\n"
                + run.comm_counter.summary(layers, run.ctx.num_microbatches)
            )
        nonfinite.check(result, progress.iteration)
        if progress.iteration % train_cfg.eval_interval == 0 or progress.iteration == train_cfg.train_iters:
            run_evaluation(run)
        stop = bool(train_cfg.exit_interval and progress.iteration % train_cfg.exit_interval == 0)
        interval = cfg.checkpoint.save_interval
        if stop or progress.iteration == train_cfg.train_iters or (interval and progress.iteration % interval == 0):
            save(run)
        if stop:
            run.logger.info(f"exit condition reached after iteration {progress.iteration}")
            break
    if run.checkpointer is not None:
        run.checkpointer.wait()  # an async save in flight completes (and reports) before the run ends
    run.metrics.close()
    barrier(run.env)
    run.logger.info(
        f"done. metrics: {os.path.join(cfg.run.dir, 'metrics.jsonl')} | TensorBoard: "
        f"{run.metrics.tensorboard_dir} | checkpoints: {run.checkpoint_root}"
    )


def run_training(config: Config, env: DistEnv, layout: Layout, preemption: PreemptionHandler) -> int:
    """Build, resume, train; returns the exit code (training.guards)."""
    try:  # bad input found while building (data files, tokenizer, checkpoint): one line, exit 2
        run = build_run(config, env, layout)
        run.preemption = preemption
        resume_if_asked(run)
    except (ValueError, OSError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    try:
        try:
            train(run)
        except TrainingStopped:
            if run.checkpointer is not None:
                run.checkpointer.wait()  # the stop's checkpoint, written in the background, completes first
            raise
    except CheckpointError as err:  # a failed save: one line; the previous checkpoint stays the latest
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
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Run the trainer; returns the exit code (0 done, 2 bad input, 3 stopped by a signal, 4 diverged:
    see training/guards.py)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config = load_config(args.config, args.overrides)
        layout = layout_from_config(config, world_size)  # every layout rule, before any work
        use_cuda = check_devices(config.train, os.environ)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    created_dir = not os.path.exists(config.run.dir)
    lock = RunLock(config.run.dir)
    with PreemptionHandler() as preemption:  # from here on a signal stops at an iteration boundary
        env = init_distributed(use_cuda, config.train.num_threads)
        try:
            error = take_run_lock(lock, env.rank, env.world_size, env.device)
            if error is not None:
                if error:
                    print(f"error: {error}", file=sys.stderr)
                return EXIT_INPUT_ERROR
            if lock.broke_stale is not None:
                print(
                    f"warning: removed the stale lock of pid {lock.broke_stale.get('pid')} on host "
                    f"{lock.broke_stale.get('host')} from {lock.path}",
                    file=sys.stderr,
                )
            return run_training(config, env, layout, preemption)
        except Interrupted as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_INTERRUPTED
        finally:
            lock.release()
            if created_dir and env.rank == 0 and os.path.isdir(config.run.dir) and not os.listdir(config.run.dir):
                os.rmdir(config.run.dir)  # a start that failed before writing anything leaves no folder
            if dist.is_initialized():
                dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
