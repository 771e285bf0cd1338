"""The forward side of a pipeline step, shared by training and every forward-only pass: the function the
executor runs per micro-batch (a chunk's output, or on the last chunk Megatron's loss), the micro-batches' way
to the device, the global mean loss, and `evaluate` (validation, evaluation/'s losses and windows) over a
rank's forward-only plan. Here, beside the executor it drives, so that evaluation/ runs what validation runs
without importing training/.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from data.microbatch import Microbatch
from model.gpt import GPTModel
from parallel.context_parallel import cut_microbatch
from parallel.layout import Layout
from parallel.pipeline.executor import ForwardFn, execute_schedule
from parallel.pipeline.plan import PipelinePlan
from parallel.state import ParallelState


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


def to_device(microbatch: Microbatch, device: torch.device, state: ParallelState) -> Microbatch:
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


def global_mean_loss(losses: list[torch.Tensor], state: ParallelState) -> float:
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
        microbatches = [to_device(mb, ctx.device, ctx.state) for mb in microbatches]
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
        total += global_mean_loss(result.losses, ctx.state)
    for chunk in ctx.chunks:
        chunk.train()
    return total / max(eval_iters, 1)
