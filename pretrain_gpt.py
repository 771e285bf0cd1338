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
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import yaml

from data.tokenizers import build_tokenizer
from parallel.data_parallel import DataParallel
from parallel.layout import Layout, layout_from_config
from parallel.model_builder import build_model_chunks, count_parameters
from parallel.random import RNGTracker, make_checkpoint_fn
from parallel.state import ParallelState
from parallel.tensor_parallel import CommCounter
from training.checkpointing import CheckpointError, TrainingProgress, load_checkpoint, save_checkpoint
from training.config import Config, ConfigError, load_config
from training.flops import flops_per_iteration
from training.logging import IntervalStats, MetricsWriter, format_train_line, get_logger
from training.lr_schedule import LRSchedule
from training.optimizer import DistributedOptimizer, Optimizer, build_optimizer
from training.setup import (REPO_ROOT, DatasetSplits, DistEnv, barrier, build_datasets, data_iterator,
                            init_distributed, log_kernel_choices, param_dtype, resolve_sample_data)
from training.train_step import StepContext, evaluate, train_step

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


def prepare_data(config: Config, env: DistEnv, logger: logging.Logger) -> tuple[int, DatasetSplits]:
    """Tokenizer (which fills in model.vocab_size) and datasets; then the resolved config is saved.
    Returns the end-of-document id and the datasets."""
    resolve_sample_data(config, env, logger)
    data = config.data
    tokenizer = build_tokenizer(data.tokenizer_type, vocab_file=data.vocab_file, merge_file=data.merge_file,
                                tokenizer_model=data.tokenizer_model)
    if config.model.vocab_size is None:
        config.model.vocab_size = tokenizer.vocab_size
    datasets = build_datasets(config, env, config.train.global_batch_size)
    if env.rank == 0:  # written once the inputs have proved readable: a failed start leaves no run folder
        os.makedirs(config.run.dir, exist_ok=True)
        with open(os.path.join(config.run.dir, "config.yaml"), "w", encoding="utf-8") as handle:
            yaml.safe_dump(config.to_dict(), handle, sort_keys=False)
        logger.info("resolved config:\n" + yaml.safe_dump(config.to_dict(), sort_keys=False).rstrip())
    return tokenizer.eod, datasets


def build_optimizer_and_schedule(config: Config, chunks: list, state: ParallelState
                                 ) -> tuple[DataParallel, Optimizer | DistributedOptimizer, LRSchedule]:
    """Gradient buffers (data parallelism), the (distributed) optimizer and the LR schedule."""
    par, train_cfg, optim = config.parallel, config.train, config.optim
    ddp = DataParallel(chunks, state, bucket_size_mb=par.grad_bucket_size_mb,
                       distributed_optimizer=par.distributed_optimizer, grad_dtype=torch.float32)
    optimizer = build_optimizer(
        chunks, ddp, state, lr=optim.lr, weight_decay=optim.weight_decay,
        betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps, clip_grad=train_cfg.clip_grad,
        precision=train_cfg.precision,
        loss_scale_cfg=dict(initial=optim.initial_loss_scale, min=optim.min_loss_scale,
                            window=optim.loss_scale_window, hysteresis=optim.hysteresis))
    lr_schedule = LRSchedule(optim.lr, optim.min_lr, optim.lr_warmup_iters,
                             optim.lr_decay_iters or train_cfg.train_iters, optim.lr_decay_style)
    return ddp, optimizer, lr_schedule


def build_run(config: Config, env: DistEnv, layout: Layout) -> Run:
    """Parallel state, data, model chunks, optimizer, schedule; resume from the latest checkpoint if asked."""
    par, train_cfg, model_cfg = config.parallel, config.train, config.model
    logger = get_logger(env.rank)
    state = ParallelState.from_layout(layout)
    logger.info(f"layout: {layout.describe()}; {state.describe()}; device {env.device}")
    eod_id, datasets = prepare_data(config, env, logger)
    dtype = param_dtype(train_cfg.precision)
    rng_tracker = RNGTracker.seeded(train_cfg.seed, state.tp_rank, state.pp_rank, env.device)
    comm_counter = CommCounter()
    chunks = build_model_chunks(
        model_cfg, state, train_cfg.seed, env.device, dtype, layout.sequence_parallel, rng_tracker=rng_tracker,
        comm_counter=comm_counter, checkpoint_fn=make_checkpoint_fn(rng_tracker), recompute=train_cfg.recompute,
        recompute_method=train_cfg.recompute_method, recompute_num_layers=train_cfg.recompute_num_layers,
        compile_layers=train_cfg.compile, compile_backend=train_cfg.compile_backend)
    log_kernel_choices(chunks, model_cfg, train_cfg.micro_batch_size, state.tp_size, env.device, dtype, logger)
    ddp, optimizer, lr_schedule = build_optimizer_and_schedule(config, chunks, state)
    seq_local = model_cfg.seq_length // (layout.tp_size if layout.sequence_parallel else 1)
    ctx = StepContext(chunks=chunks, state=state, layout=layout, ddp=ddp, optimizer=optimizer,
                      activation_shape=(seq_local, train_cfg.micro_batch_size, model_cfg.hidden_size),
                      activation_dtype=dtype, device=env.device,
                      scatter_gather=par.scatter_gather and not layout.sequence_parallel)
    params = _all_reduce_int(count_parameters(chunks, state), state.model_parallel_group, state)
    logger.info(f"model: {params / 1e6:.2f} M parameters, padded vocabulary {model_cfg.padded_vocab_size(state.tp_size)}"
                f", {layout.num_microbatches} micro-batches of {train_cfg.micro_batch_size} per dp rank, {dtype}; "
                f"optimizer state {optimizer.state_bytes() / 2**20:.1f} MiB on rank {state.rank}")
    flops = flops_per_iteration(train_cfg.global_batch_size, model_cfg.seq_length, model_cfg.num_layers,
                                model_cfg.hidden_size, model_cfg.padded_vocab_size(state.tp_size),
                                full_recompute=train_cfg.recompute == "full")
    return Run(config=config, env=env, layout=layout, state=state, ctx=ctx, lr_schedule=lr_schedule,
               rng_tracker=rng_tracker, comm_counter=comm_counter, datasets=datasets, eod_id=eod_id,
               progress=TrainingProgress(),
               metrics=MetricsWriter(config.run.dir, env.rank == 0, config.logging.tensorboard), logger=logger,
               checkpoint_root=os.path.join(config.run.dir, "checkpoints"), flops_per_iter=flops)


def _all_reduce_int(value: int, group: Optional[dist.ProcessGroup], state: ParallelState) -> int:
    if not state.is_distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, group=group)
    return int(tensor.item())


def resume_if_asked(run: Run) -> None:
    """checkpoint.load=true: continue exactly from the latest checkpoint under run.dir/checkpoints."""
    if not run.config.checkpoint.load:
        return
    ctx = run.ctx
    loaded = load_checkpoint(run.checkpoint_root, run.state, ctx.chunks, ctx.optimizer, run.lr_schedule,
                             run.config.parallel.distributed_optimizer)
    if loaded is None:
        run.logger.info(f"checkpoint.load=true but no checkpoint under {run.checkpoint_root}: starting fresh")
        return
    run.progress, rng_state = loaded
    run.rng_tracker.load_state_dict(rng_state)
    run.metrics.truncate_after(run.progress.iteration)
    run.logger.info(f"resumed from iteration {run.progress.iteration} "
                    f"({run.progress.consumed_samples} samples consumed)")


def save(run: Run) -> None:
    if not run.config.checkpoint.save:
        return
    ctx = run.ctx
    path = save_checkpoint(run.checkpoint_root, run.state, run.progress, ctx.chunks, ctx.optimizer,
                           run.lr_schedule, run.rng_tracker.state_dict(), run.config.to_dict(),
                           run.config.parallel.distributed_optimizer)
    run.logger.info(f"saved checkpoint {path}")


def run_evaluation(run: Run) -> None:
    """Validation loss and perplexity on the first eval_iters global batches of the valid split."""
    train_cfg, state = run.config.train, run.state
    if run.datasets[1] is None or train_cfg.eval_iters == 0:
        return
    # A fresh in-process iterator each time: every evaluation scores the same batches, so values compare.
    valid_iter = data_iterator(run.config, run.datasets[1], 0, state.dp_rank, state.dp_size, run.eod_id,
                               num_workers=0)
    val_loss = evaluate(run.ctx, valid_iter, train_cfg.eval_iters)
    val_ppl = float(torch.exp(torch.tensor(min(val_loss, 20.0))))
    run.logger.info(f"validation at iteration {run.progress.iteration}: loss {val_loss:.4f} | ppl {val_ppl:.3f}")
    run.metrics.write({"iteration": run.progress.iteration, "val_loss": val_loss, "val_ppl": val_ppl})


def should_exit(run: Run, start_time: float) -> bool:
    """train.exit_interval / train.exit_duration_mins, agreed on by every rank."""
    train_cfg = run.config.train
    stop = bool(train_cfg.exit_interval and run.progress.iteration % train_cfg.exit_interval == 0)
    if train_cfg.exit_duration_mins:
        over = (time.time() - start_time) / 60.0 >= train_cfg.exit_duration_mins
        flag = torch.tensor([int(over)])
        if run.state.is_distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank must stop at the same iteration
        stop = stop or bool(flag.item())
    return stop


def train(run: Run) -> None:
    """The training loop: step, log, evaluate, save, until train_iters or an exit condition."""
    cfg, train_cfg, state = run.config, run.config.train, run.state
    start_time = time.time()
    train_iter = data_iterator(cfg, run.datasets[0], run.progress.consumed_samples, state.dp_rank,
                               state.dp_size, run.eod_id)
    if run.progress.iteration == 0:
        run_evaluation(run)
    run.comm_counter.reset()  # count the first training iteration only, not the evaluation before it
    iteration_one = run.progress.iteration + 1
    stats = IntervalStats(run.flops_per_iter, cfg.train.global_batch_size * cfg.model.seq_length,
                          run.env.world_size, run.env.device.type)
    while run.progress.iteration < train_cfg.train_iters:
        lr = run.lr_schedule.lr(run.progress.iteration)
        started = time.perf_counter()
        result = train_step(run.ctx, train_iter, lr)
        if run.env.device.type == "cuda":
            torch.cuda.synchronize()
        progress = run.progress
        progress.iteration += 1
        progress.consumed_samples += train_cfg.global_batch_size
        progress.skipped_iters += int(result.skipped)
        stats.add(result, lr, time.perf_counter() - started)
        if progress.iteration == iteration_one and train_cfg.compile:
            run.logger.info(f"train.compile: iteration {iteration_one} took {time.perf_counter() - started:.1f} s, "
                            f"compiling the transformer layers included (regional, once per layer code)")
        if progress.iteration == iteration_one and state.tp_size > 1:
            layers = sum(len(chunk.layers) for chunk in run.ctx.chunks)
            run.logger.info(f"tensor-parallel collectives of iteration {iteration_one} on rank {state.rank}:\n"
                            + run.comm_counter.summary(layers, run.ctx.num_microbatches))
        if progress.iteration % cfg.logging.log_interval == 0:
            record = stats.flush(progress)
            run.logger.info(format_train_line(record, train_cfg.train_iters))
            run.metrics.write(record)
        if progress.iteration % train_cfg.eval_interval == 0 or progress.iteration == train_cfg.train_iters:
            run_evaluation(run)
        stop = should_exit(run, start_time)
        interval = cfg.checkpoint.save_interval
        if stop or progress.iteration == train_cfg.train_iters or (interval and progress.iteration % interval == 0):
            save(run)
        if stop:
            run.logger.info(f"exit condition reached after iteration {progress.iteration}")
            break
    run.metrics.close()
    barrier(run.env)
    run.logger.info(f"done. metrics: {os.path.join(cfg.run.dir, 'metrics.jsonl')} | TensorBoard: "
                    f"{run.metrics.tensorboard_dir} | checkpoints: {run.checkpoint_root}")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config = load_config(args.config, args.overrides)
        layout = layout_from_config(config, world_size)  # every layout rule, before any work
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    env = init_distributed()
    try:
        try:  # bad input found while building (data files, tokenizer, checkpoint): one line, exit 2
            run = build_run(config, env, layout)
            resume_if_asked(run)
        except (ValueError, OSError, CheckpointError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        train(run)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
