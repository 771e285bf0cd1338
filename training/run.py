"""Building a run: everything the training loop touches, made once from the config, with the checkpoint it
starts from loaded into it (`build_run`; `resume_if_asked` then continues the run's records from there).

Order matters for a clean failure: the tokenizer, the checkpoint to resume and the datasets are checked before
anything is written (see `prepare_data`), and the checkpoint's data files, verified as they are loaded, are
loaded before the run writes its config and opens its metrics: a start with bad input leaves no run folder
behind, and a refused resume leaves the run's folder as it was.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import yaml

from checkpoint import (
    Checkpointer,
    CheckpointLayout,
    CheckpointParts,
    ResumePlan,
    TrainingProgress,
    load_into_run,
    plan_resume,
)
from config.schema import Config
from data.tokenizers import build_tokenizer
from model.gpt import GPTModel
from model.precision import precision_dtype
from model.rank_spec import Recompute
from model.shape import active_params
from operations.faults import COLLECTIVE_KINDS, FaultInjector, FaultSpec
from operations.log import get_logger
from operations.preemption import PreemptionHandler
from operations.startup import (
    DatasetSplits,
    DistEnv,
    build_datasets,
    check_vocab_size,
    log_kernel_choices,
    resolve_sample_data,
)
from operations.straggler import StragglerReport
from operations.watchdog import HangGuard
from optim.lr_schedule import LRSchedule
from optim.optimizer import Optimizer, build_optimizer
from optim.sharded_optimizer import build_sharded_optimizer
from parallel.comm import Collectives
from parallel.comm_recorder import CommRecorder
from parallel.data_parallel import DataParallel
from parallel.fsdp import ShardedDataParallel
from parallel.grad_sync import GradientSync
from parallel.layout import Layout
from parallel.model_builder import build_model_chunks, count_parameters, rank_spec
from parallel.random import RNGTracker, make_checkpoint_fn
from parallel.run_shape import RunShape
from parallel.state import ParallelState
from parallel.tp_mappings import CommCounter
from training.logging import MetricsWriter
from training.train_step import StepContext
from training.wandb_logging import open_wandb


@dataclass
class LoopState:
    """What the training loop changes as it runs: its counters (set from the checkpoint by `build_run`)
    and the iteration of the checkpoint this run last wrote or loaded."""

    progress: TrainingProgress = field(default_factory=TrainingProgress)
    last_saved: int = -1


@dataclass(frozen=True)
class RunGuards:
    """What watches the run and may stop it (operations/), each None where it is off."""

    preemption: PreemptionHandler | None = None  # stop signals: save and exit 3
    hang_guard: HangGuard | None = None  # timeouts, watchdog, hang dumps (operations/watchdog.py)
    straggler: StragglerReport | None = None  # every logging.straggler_interval iterations (operations/straggler.py)
    fault: FaultSpec | None = None  # PTDP_INJECT_FAULT; the loop raises kind=raise's error (operations/faults.py)


@dataclass(frozen=True)
class Run:
    """Everything the loop touches, built once by `build_run`; what changes as it trains is `loop`."""

    config: Config  # as loaded, with model.vocab_size the tokenizer's where it was unset (`prepare_data`)
    env: DistEnv
    layout: Layout
    shape: RunShape  # what follows from the model and the layout: FLOPs, chunks, vocabulary, sequence
    state: ParallelState
    ctx: StepContext
    lr_schedule: LRSchedule
    rng_tracker: RNGTracker
    comm_counter: CommCounter
    datasets: DatasetSplits  # train, valid, test (valid/test may be None)
    eod_id: int
    metrics: MetricsWriter
    logger: logging.Logger
    checkpoint_root: str
    resume_plan: ResumePlan | None  # the checkpoint to start from; None: start fresh
    checkpointer: Checkpointer | None  # None with checkpoint.save=false
    guards: RunGuards
    loop: LoopState

    @property
    def progress(self) -> TrainingProgress:
        """The loop's counters (`loop.progress`): iteration, consumed samples, skipped iterations."""
        return self.loop.progress

    @property
    def vocab_size(self) -> int:
        """model.vocab_size of the run's config: the tokenizer's when the loaded config left it unset."""
        size = self.config.model.vocab_size
        if size is None:
            raise ValueError("model.vocab_size is unset: build the run with build_run, which resolves it")
        return size

    def checkpoint_parts(self) -> CheckpointParts:
        """What this run's checkpoints are written from and loaded into."""
        return checkpoint_parts(self.config, self.layout, self.ctx, self.lr_schedule, self.rng_tracker)


def checkpoint_parts(
    config: Config, layout: Layout, ctx: StepContext, lr_schedule: LRSchedule, rng_tracker: RNGTracker
) -> CheckpointParts:
    """What a run's checkpoints are written from and loaded into (`Run.checkpoint_parts`; `build_run` loads
    into them before the Run exists)."""
    recorded = CheckpointLayout.of(
        ctx.state, layout.sequence_parallel, config.parallel.distributed_optimizer, layout.schedule
    )
    return CheckpointParts(ctx.state, ctx.chunks, ctx.optimizer, lr_schedule, rng_tracker, recorded)


def prepare_data(
    config: Config, env: DistEnv, logger: logging.Logger, comm: Collectives | None = None
) -> tuple[Config, int, DatasetSplits, ResumePlan | None]:
    """Tokenizer (its vocabulary size resolves an unset model.vocab_size), the checkpoint to start from (checked
    against the resolved config and verified, all but its data files, before anything is written) and datasets.
    Nothing is written (`save_resolved_config` follows once the checkpoint is loaded). Its collectives go through
    `comm` (None: the world's door, `env.comm`). Returns the resolved config (a new value: the vocabulary size is
    not written into `config`), the end-of-document id, the datasets and the resume plan."""
    comm = comm if comm is not None else env.comm
    resolve_sample_data(config, env, logger, comm)
    data = config.data
    tokenizer = build_tokenizer(
        data.tokenizer_type,
        vocab_file=data.vocab_file,
        merge_file=data.merge_file,
        tokenizer_model=data.tokenizer_model,
        vocab_size=config.model.vocab_size,
    )
    vocab_size = tokenizer.vocab_size if config.model.vocab_size is None else config.model.vocab_size
    check_vocab_size(vocab_size, tokenizer.vocab_size, data)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=vocab_size))
    resume_plan = plan_resume(config, os.path.join(config.run.dir, "checkpoints"), logger.info, env.rank == 0, comm)
    datasets = build_datasets(config, env, config.train.global_batch_size, comm)
    return config, tokenizer.eod, datasets, resume_plan


def save_resolved_config(config: Config, env: DistEnv, logger: logging.Logger) -> None:
    """run.dir/config.yaml (rank 0), written once the inputs have proved readable (the checkpoint loaded): a
    failed start leaves no run folder, a refused resume the previous run's config."""
    if env.rank != 0:
        return
    os.makedirs(config.run.dir, exist_ok=True)
    resolved = yaml.safe_dump(config.to_dict(), sort_keys=False)
    with open(os.path.join(config.run.dir, "config.yaml"), "w", encoding="utf-8") as handle:
        handle.write(resolved)
    logger.info("resolved config:\n" + resolved.rstrip())


def build_optimizer_and_schedule(
    config: Config, chunks: list[torch.nn.Module], state: ParallelState, layout: Layout
) -> tuple[GradientSync, Optimizer, LRSchedule]:
    """The data-parallel flavour with the optimizer that matches it, and the LR schedule: FSDP's shards
    (parallel.fsdp) with the sharded optimizer, or gradient buckets over whole parameters (with the distributed
    optimizer: reduce-scattered into its shards). The step does not know which it got."""
    par = config.parallel
    lr_schedule = LRSchedule.of(config.optim, config.train.train_iters)
    if layout.fsdp:
        compute_dtype = precision_dtype(config.train.precision)
        sharded = ShardedDataParallel(chunks, state, compute_dtype, par.fsdp_reshard_after_forward)
        return sharded, build_sharded_optimizer(chunks, sharded, state, config.optim, config.train), lr_schedule
    ddp = DataParallel(
        chunks,
        state,
        bucket_size_mb=par.grad_bucket_size_mb,
        distributed_optimizer=par.distributed_optimizer,
        grad_dtype=torch.float32,
    )
    optimizer = build_optimizer(
        chunks, ddp, state, config.optim, config.train, overlap_param_gather=par.overlap_param_gather
    )
    return ddp, optimizer, lr_schedule


def build_chunks(
    config: Config,
    env: DistEnv,
    layout: Layout,
    state: ParallelState,
    rng_tracker: RNGTracker,
    comm: CommCounter,
    logger: logging.Logger,
) -> list[GPTModel]:
    """This rank's model chunks (its virtual pipeline stages, tp-sharded), in the run's parameter dtype."""
    train_cfg, model_cfg = config.train, config.model
    # FSDP keeps the sharded parameters in fp32 (the master weights) and computes in the run's precision
    dtype = torch.float32 if layout.fsdp else precision_dtype(train_cfg.precision)
    recompute = Recompute(
        train_cfg.recompute, train_cfg.recompute_method, train_cfg.recompute_num_layers, make_checkpoint_fn(rng_tracker)
    )
    spec = rank_spec(model_cfg, state, layout.sequence_parallel, rng_tracker, comm, recompute)
    chunks = build_model_chunks(
        model_cfg,
        state,
        train_cfg.seed,
        env.device,
        dtype,
        spec,
        compile_backend=train_cfg.compile_backend if train_cfg.compile else None,
    )
    log_kernel_choices(
        chunks, model_cfg, train_cfg.micro_batch_size, state.tp_size, env.device, dtype, get_logger(env.rank)
    )
    return chunks


def build_state(
    config: Config,
    env: DistEnv,
    layout: Layout,
    guard: HangGuard | None,
    fault: FaultSpec | None,
    logger: logging.Logger,
) -> ParallelState:
    """The parallel state with its recorder (the latest collectives of this rank, always kept: the world door's,
    `env.comm`, so the start-up's calls before the state are in the same records), its groups on the start-up
    timeout, the hang guard started, and the fault-injection test hook on the rank it names."""
    recorder = env.comm.recorder if env.comm.recorder is not None else CommRecorder()
    state = ParallelState.from_layout(layout, recorder, config.parallel.init_timeout_s)
    logger.info(f"layout: {layout.describe()}; {state.describe()}; device {env.device}")
    if guard is not None:
        guard.start(state)
    if fault is not None:
        logger.info(fault.describe())
        if fault.rank == env.rank != 0:  # the rank it acts on says so too (INFO shows on rank 0 only)
            logger.warning(fault.describe())
        if fault.rank == env.rank and fault.kind in COLLECTIVE_KINDS and state.comm.recorder is not None:
            state.comm.before_issue = FaultInjector(fault, state.comm.recorder, logger)
    return state


def build_run(
    config: Config,
    env: DistEnv,
    layout: Layout,
    guard: HangGuard | None = None,
    fault: FaultSpec | None = None,
    preemption: PreemptionHandler | None = None,
) -> Run:
    """Parallel state, data, model chunks, optimizer, schedule, and the checkpoint to resume from if asked,
    loaded into them before the run writes anything (its config, its metrics): the load verifies the data files
    as it reads them. `guard` (timeouts and watchdog) starts as soon as the state exists; `fault` is
    PTDP_INJECT_FAULT's; `preemption` turns stop signals into a save. `config` is not changed: the run holds
    the resolved one (`prepare_data`)."""
    logger = get_logger(env.rank)
    state = build_state(config, env, layout, guard, fault, logger)
    config, eod_id, datasets, resume_plan = prepare_data(config, env, logger, state.comm)
    par, train_cfg = config.parallel, config.train
    dtype = precision_dtype(train_cfg.precision)
    rng_tracker = RNGTracker.seeded(train_cfg.seed, state.tp_rank, state.pp_rank, env.device)
    comm_counter = CommCounter(compiled=train_cfg.compile)
    chunks = build_chunks(config, env, layout, state, rng_tracker, comm_counter, logger)
    if par.fsdp and not layout.fsdp:
        logger.info(
            "parallel.fsdp=true with one data-parallel rank (dp x cp = 1): nothing to shard, plain data parallelism"
        )
    # A list of the same modules, typed as DataParallel and the optimizer take it (lists are invariant).
    ddp, optimizer, lr_schedule = build_optimizer_and_schedule(config, list[torch.nn.Module](chunks), state, layout)
    shape = RunShape.of(config, layout)
    ctx = StepContext(
        chunks=chunks,
        state=state,
        layout=layout,
        ddp=ddp,
        optimizer=optimizer,
        activation_shape=shape.activation_shape,
        activation_dtype=dtype,
        device=env.device,
        scatter_gather=par.scatter_gather and not layout.sequence_parallel,
        overlap_p2p_comm=par.overlap_p2p_comm,
    )
    log_model_summary(logger, chunks, state, shape, layout, train_cfg.micro_batch_size, dtype, optimizer)
    progress = TrainingProgress()
    if resume_plan is not None:  # a damaged data file raises here, with nothing of the run written
        parts = checkpoint_parts(config, layout, ctx, lr_schedule, rng_tracker)
        progress = load_into_run(resume_plan, config, parts, logger.info)
    save_resolved_config(config, env, logger)
    return Run(
        config=config,
        env=env,
        layout=layout,
        shape=shape,
        state=state,
        ctx=ctx,
        lr_schedule=lr_schedule,
        rng_tracker=rng_tracker,
        comm_counter=comm_counter,
        datasets=datasets,
        eod_id=eod_id,
        metrics=MetricsWriter(
            config.run.dir, env.rank == 0, config.logging.tensorboard, open_wandb(config, env.rank == 0)
        ),
        logger=logger,
        checkpoint_root=os.path.join(config.run.dir, "checkpoints"),
        resume_plan=resume_plan,
        checkpointer=(
            Checkpointer(config.checkpoint.async_save, logger.info, state.comm, par.init_timeout_s)
            if config.checkpoint.save
            else None
        ),
        guards=RunGuards(
            preemption=preemption,
            hang_guard=guard,
            straggler=StragglerReport(
                config.logging.straggler_interval, config.logging.straggler_threshold, state, env.device
            ),
            fault=fault,
        ),
        loop=LoopState(progress),
    )


def log_model_summary(
    logger: logging.Logger,
    chunks: list[GPTModel],
    state: ParallelState,
    shape: RunShape,
    layout: Layout,
    micro_batch_size: int,
    dtype: torch.dtype,
    optimizer: Optimizer,
) -> None:
    """The start-up line on the model (its parameters summed over the model-parallel ranks) and this rank's
    optimizer state."""
    params = _all_reduce_int(count_parameters(chunks, state), state.model_parallel_group, state)
    cfg = chunks[0].cfg
    active = ""
    if cfg.num_experts:  # what a token goes through: top_k of each MoE layer's experts (model/shape.py)
        active = f" ({active_params(cfg) / 1e6:.2f} M active: top-{cfg.moe_router_topk} of {cfg.num_experts} experts)"
    logger.info(
        f"model: {params / 1e6:.2f} M parameters{active}, padded vocabulary {shape.padded_vocab}"
        f", {layout.num_microbatches} micro-batches of {micro_batch_size} per dp rank, {dtype}; "
        f"optimizer state {optimizer.state_bytes() / 2**20:.1f} MiB on rank {state.rank}"
    )


def _all_reduce_int(value: int, group: dist.ProcessGroup | None, state: ParallelState) -> int:
    if not state.is_distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    state.comm.all_reduce(tensor, group)
    return int(tensor.item())


def resume_if_asked(run: Run) -> None:
    """Continue the run's records from the checkpoint `build_run` loaded (checkpoint.load: true, a checkpoints
    folder or one iter_XXXXXXX; weights only with checkpoint.finetune / checkpoint.load_optimizer=false, at any
    layout): metrics.jsonl cut back to its iteration; without one, a previous metrics.jsonl set aside."""
    if run.resume_plan is None:  # iteration 0: an old metrics.jsonl here belongs to an earlier attempt
        moved = run.metrics.set_aside()
        if moved:
            run.logger.info(f"starting at iteration 0: the previous {run.metrics.path} was moved to {moved}")
        return
    run.loop.last_saved = run.progress.iteration
    run.metrics.truncate_after(run.progress.iteration)
    run.logger.info(
        f"{'resumed from' if run.progress.iteration else 'starting at'} iteration "
        f"{run.progress.iteration} ({run.progress.consumed_samples} samples consumed)"
    )
    if run.progress.iteration >= run.config.train.train_iters:  # a finished run: say so, not a silent exit 0
        run.logger.info(
            f"nothing to train: the checkpoint is at iteration {run.progress.iteration} and "
            f"train.train_iters={run.config.train.train_iters}; raise train.train_iters to train on"
        )
