"""One training iteration over the model chunks of this rank (its forward side and the forward-only pass:
parallel/pipeline/forward.py).

The same path serves every layout: the pipeline executor walks this rank's schedule (with pp = 1 that is just
forward/backward per micro-batch), data parallelism reduces gradients while the last backward runs (under a
zero-bubble schedule: the last weight-gradient action, which is when the weights' gradients are complete), then
the tied-embedding and sequence-parallel gradients are reduced and the optimizer steps (then the MoE routers'
expert biases, training/moe_step.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from data.microbatch import Microbatch
from model.gpt import GPTModel
from optim.optimizer import Optimizer
from parallel.grad_sync import GradientSync
from parallel.grad_utils import finalize_model_grads
from parallel.layout import Layout
from parallel.pipeline.executor import execute_schedule
from parallel.pipeline.forward import global_mean_loss, make_forward_fn, to_device
from parallel.pipeline.plan import PipelinePlan, build_plan
from parallel.state import ParallelState
from training.moe_step import set_aux_loss_scale, step_metrics, update_expert_biases


@dataclass
class StepContext:
    """What a step needs besides the batch; built once by pretrain_gpt.py (by keyword).

    The pipeline plans (this rank's action list and communication steps, for training and for
    evaluation) are built here, once: every iteration runs the same plans.
    """

    chunks: list[GPTModel]
    state: ParallelState
    layout: Layout
    ddp: GradientSync  # the data-parallel flavour (DataParallel or ShardedDataParallel)
    optimizer: Optimizer  # the one matching `ddp`: plain, distributed (ZeRO-1) or sharded (FSDP)
    activation_shape: tuple[int, int, int]  # [s(/tp with sequence parallelism), b, h] between stages
    activation_dtype: torch.dtype
    device: torch.device
    scatter_gather: bool
    overlap_p2p_comm: bool  # compute while pipeline messages are in flight (executor docstring)
    train_plan: PipelinePlan = field(init=False)
    eval_plan: PipelinePlan = field(init=False)

    def __post_init__(self) -> None:
        layout, pp_rank = self.layout, self.state.pp_rank
        self.train_plan = build_plan(layout.schedule, layout.pp_size, pp_rank, layout.num_microbatches, layout.vp_size)
        self.eval_plan = build_plan(
            layout.schedule, layout.pp_size, pp_rank, layout.num_microbatches, layout.vp_size, forward_only=True
        )

    @property
    def num_microbatches(self) -> int:
        return self.layout.num_microbatches


@dataclass
class StepResult:
    loss: float  # mean loss of the global batch (same on every rank)
    grad_norm: float
    skipped: bool
    loss_scale: float
    max_in_flight: int
    moe: dict[str, float] = field(default_factory=dict)  # routing metrics (training/moe_step.step_metrics)


def train_step(
    ctx: StepContext, microbatches: list[Microbatch], lr: float, before_update: Callable[[], None] | None = None
) -> StepResult:
    """Forward/backward over this rank's micro-batches of the global batch (from `take_microbatches`),
    gradient reduction, clipping and the optimizer step.
    `before_update()` runs just before the step changes any weight (an async checkpoint copy finishes)."""
    for chunk in ctx.chunks:
        chunk.train()
    microbatches = [to_device(mb, ctx.device, ctx.state) for mb in microbatches]
    ctx.ddp.zero_grad()
    set_aux_loss_scale(ctx.chunks, ctx.optimizer.loss_scale / ctx.num_microbatches)
    result = execute_schedule(
        ctx.train_plan,
        ctx.chunks,
        microbatches,
        make_forward_fn(ctx.num_microbatches),
        ctx.state,
        ctx.activation_shape,
        ctx.activation_dtype,
        scatter_gather=ctx.scatter_gather,
        loss_scale=ctx.optimizer.loss_scale,
        on_last_backward=ctx.ddp.enable_grad_sync,
        overlap_p2p_comm=ctx.overlap_p2p_comm,
    )
    ctx.ddp.finish_grad_sync()
    finalize_model_grads(ctx.chunks, ctx.state, ctx.ddp)
    if before_update is not None:
        before_update()
    stats = ctx.optimizer.step(lr)
    update_expert_biases(ctx.chunks, ctx.state)  # every step, skipped or not, as megatron-core's
    cfg = ctx.chunks[0].cfg
    return StepResult(
        loss=global_mean_loss(result.losses, ctx.state),
        grad_norm=stats.grad_norm,
        skipped=stats.skipped,
        loss_scale=stats.loss_scale,
        max_in_flight=result.max_in_flight,
        moe=step_metrics(ctx.chunks, ctx.state, cfg.num_layers, cfg.num_experts or 0),
    )
