"""One training iteration and one evaluation pass over the model chunks of this rank.

The same path serves every layout: the pipeline executor walks this rank's schedule (with pp = 1 that is just
forward/backward per micro-batch), data parallelism reduces gradients while the last backward runs (under a
zero-bubble schedule: the last weight-gradient action, which is when the weights' gradients are complete), then
the tied-embedding and sequence-parallel gradients are reduced and the optimizer steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from data.microbatch import Microbatch
from model.gpt import GPTModel
from optim.optimizer import DistributedOptimizer, Optimizer
from parallel.context_parallel import cut_microbatch
from parallel.data_parallel import DataParallel
from parallel.fsdp import ShardedDataParallel
from parallel.grad_utils import finalize_model_grads
from parallel.layout import Layout
from parallel.pipeline.executor import ForwardFn, execute_schedule
from parallel.pipeline.plan import PipelinePlan, build_plan
from parallel.state import ParallelState


@dataclass
class StepContext:
    """What a step needs besides the batch; built once by pretrain_gpt.py (by keyword).

    The pipeline plans (this rank's action list and communication steps, for training and for
    evaluation) are built here, once: every iteration runs the same plans.
    """

    chunks: list[GPTModel]
    state: ParallelState
    layout: Layout
    ddp: DataParallel | ShardedDataParallel  # the data-parallel flavour: the step calls the same methods on each
    optimizer: Optimizer | DistributedOptimizer
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


class ForwardOnlyContext(Protocol):
    """What a forward-only pass (`evaluate`) reads: a StepContext, or evaluation/'s context of a model loaded
    for evaluation (no gradient buffers, no optimizer state)."""

    chunks: list[GPTModel]
    state: ParallelState
    layout: Layout
    eval_plan: PipelinePlan
    activation_shape: tuple[int, int, int]
    activation_dtype: torch.dtype
    device: torch.device
    scatter_gather: bool
    overlap_p2p_comm: bool

    @property
    def num_microbatches(self) -> int: ...


@dataclass
class StepResult:
    loss: float  # mean loss of the global batch (same on every rank)
    grad_norm: float
    skipped: bool
    loss_scale: float
    max_in_flight: int


def _to_device(microbatch: Microbatch, device: torch.device, state: ParallelState) -> Microbatch:
    """The micro-batch on the device; under context parallelism first cut to this cp rank's part of the
    sequence (after the CPU-side token checks, which name positions of the whole sample)."""
    if state.cp_size > 1:
        microbatch = cut_microbatch(microbatch, state.cp_rank, state.cp_size)
    return microbatch.to(device, non_blocking=True)


def make_forward_fn(num_microbatches: int) -> ForwardFn:
    """forward_fn for the executor: a chunk's output, or on the last chunk the micro-batch loss / m."""

    def forward_fn(
        chunk_index: int, chunk: torch.nn.Module, input_tensor: torch.Tensor | None, mb: Microbatch, /
    ) -> torch.Tensor:
        output = chunk(
            input_ids=mb.tokens if chunk.pre_process else None,
            position_ids=mb.position_ids,
            hidden_states=input_tensor,
            attention_mask=mb.attention_mask,
            labels=mb.labels if chunk.post_process else None,
        )
        if not chunk.post_process:
            return output
        # Megatron's loss: mean over the micro-batch's unmasked tokens, averaged over micro-batches. Under
        # context parallelism the denominator is the whole sequence's count and the cp parts add up.
        return (output * mb.loss_mask).sum() / mb.loss_tokens.clamp(min=1.0) / num_microbatches

    return forward_fn


def take_microbatches(data_iter: Iterator[Microbatch], count: int) -> list[Microbatch]:
    """This rank's `count` micro-batches of the next global batch, still on the CPU (where the trainer checks
    their token ids before they reach the embedding)."""
    return [next(data_iter) for _ in range(count)]


def _global_mean_loss(losses: list[torch.Tensor], state: ParallelState) -> float:
    """Sum of micro-batch losses on the last stage, summed over cp (parts of one sequence), shared with every
    stage and averaged over dp."""
    total = torch.stack(losses).sum().float().cpu() if losses else torch.zeros(())
    if state.is_distributed:
        total = total.reshape(1)
        if state.cp_size > 1:
            state.comm.all_reduce(total, state.cp_group)
        if state.pp_size > 1:
            state.comm.all_reduce(total, state.pp_group)
        if state.dp_size > 1:
            state.comm.all_reduce(total, state.dp_group)
            total /= state.dp_size
    return float(total.reshape(()))


def train_step(
    ctx: StepContext, microbatches: list[Microbatch], lr: float, before_update: Callable[[], None] | None = None
) -> StepResult:
    """Forward/backward over this rank's micro-batches of the global batch (from `take_microbatches`),
    gradient reduction, clipping and the optimizer step.
    `before_update()` runs just before the step changes any weight (an async checkpoint copy finishes)."""
    for chunk in ctx.chunks:
        chunk.train()
    microbatches = [_to_device(mb, ctx.device, ctx.state) for mb in microbatches]
    ctx.ddp.zero_grad()
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
    return StepResult(
        loss=_global_mean_loss(result.losses, ctx.state),
        grad_norm=stats.grad_norm,
        skipped=stats.skipped,
        loss_scale=stats.loss_scale,
        max_in_flight=result.max_in_flight,
    )


@torch.no_grad()
def evaluate(
    ctx: ForwardOnlyContext,
    data_iter: Iterator[Microbatch],
    eval_iters: int,
    check_batch: Callable[[list[Microbatch], int], None] | None = None,
) -> float:
    """Mean validation loss over eval_iters global batches (forward only); `check_batch(microbatches, k)`,
    if given, sees the k-th batch on the CPU first (and may raise)."""
    for chunk in ctx.chunks:
        chunk.eval()
    forward_fn = make_forward_fn(ctx.num_microbatches)
    total = 0.0
    for batch in range(eval_iters):
        microbatches = take_microbatches(data_iter, ctx.num_microbatches)
        if check_batch is not None:
            check_batch(microbatches, batch)
        microbatches = [_to_device(mb, ctx.device, ctx.state) for mb in microbatches]
        result = execute_schedule(
            ctx.eval_plan,
            ctx.chunks,
            microbatches,
            forward_fn,
            ctx.state,
            ctx.activation_shape,
            ctx.activation_dtype,
            scatter_gather=ctx.scatter_gather,
            overlap_p2p_comm=ctx.overlap_p2p_comm,
        )
        total += _global_mean_loss(result.losses, ctx.state)
    for chunk in ctx.chunks:
        chunk.train()
    return total / max(eval_iters, 1)
