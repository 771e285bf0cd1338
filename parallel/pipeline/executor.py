"""Run one rank's pipeline plan: compute forwards / backwards, exchange tensors with the neighbours.

The plan (`plan.PipelinePlan`: the action list and its communication steps) is built once per run; this
module only walks it. The same code path serves every layout: with pp = 1 there are no messages at all.

Memory: a stage output is freed as soon as it is sent. Only its autograd graph is needed for backward, so,
like Megatron, the executor replaces `out.data` with a 1-element tensor after the send and later runs
backward through the autograd engine directly (a private torch name: compat/torch_private.AUTOGRAD_ENGINE),
which does not check that the gradient's shape matches the (now tiny) output. Where that engine entry is
missing the output keeps its data and backward goes through `torch.autograd.backward` (correct, more memory).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

from compat.torch_private import autograd_engine, is_view
from parallel.pipeline.p2p import StageComm, needed_message, produced_message
from parallel.pipeline.plan import PipelinePlan
from parallel.pipeline.schedules import Action, Op, unhandled_op
from parallel.pipeline.weight_grad import DeferredWeightGrad, backward_input, engine_run
from parallel.state import ParallelState

# One micro-batch, opaque to the executor: it only hands it to the forward_fn, which reads it (the trainer's
# and evaluation's are data.microbatch.Microbatch; the executor's tests drive toy models with their own).
MicrobatchT = TypeVar("MicrobatchT")
MicrobatchT_contra = TypeVar("MicrobatchT_contra", contravariant=True)


class ForwardFn(Protocol[MicrobatchT_contra]):
    """The model-specific part of a forward, called by the executor for each forward action.

    Returns the chunk's output ([s, b, h], sent to the next virtual stage), or on the last virtual stage the
    scalar loss of the micro-batch, already divided by the number of micro-batches. `input_tensor` is None on
    virtual stage 0 (the chunk embeds the micro-batch's tokens).
    """

    def __call__(
        self,
        chunk_index: int,
        chunk: torch.nn.Module,
        input_tensor: torch.Tensor | None,
        microbatch: MicrobatchT_contra,
        /,
    ) -> torch.Tensor: ...


@dataclass
class ScheduleResult:
    """What one iteration of the pipeline returns on this rank."""

    losses: list[torch.Tensor]  # detached per-micro-batch losses (last virtual stage only), micro-batch order
    max_in_flight: int  # max number of (micro-batch, chunk) forwards whose backward (or WEIGHT) had not yet run


def deallocate_output(out: torch.Tensor) -> bool:
    """Replace `out.data` by a 1-element tensor (keeping its graph); False when that is not safe."""
    if autograd_engine() is None or is_view(out) in (True, None) or out.grad_fn is None:
        return False  # a view (or one torch cannot tell) shares its base's storage; a leaf has no graph
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)
    return True


def run_backward(out: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward from `out` with gradient `grad`, also when `out.data` was deallocated.

    Straight to the autograd engine (which checks `grad` against the graph's recorded shape): the shape check
    of torch.autograd.backward would trip on a deallocated output, and with a gradient tensor its first call
    imports torch.fx.experimental.symbolic_shapes and sympy (~0.5 CPU s at every start of the trainer)."""
    engine_run((out,), (grad,), (), keep_graph=False, accumulate=True)


@dataclass
class _Run(Generic[MicrobatchT]):
    """Mutable state of one iteration on one rank (local to `execute_schedule`)."""

    chunks: Sequence[torch.nn.Module]
    microbatches: list[MicrobatchT]
    forward_fn: ForwardFn[MicrobatchT]
    state: ParallelState
    comm: StageComm
    loss_scale: float
    forward_only: bool
    v_shape: bool = False
    # (micro-batch, chunk) -> (input, output) awaiting backward
    held: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)
    # (micro-batch, chunk) -> weight gradients awaiting their WEIGHT action (zero-bubble schedules)
    deferred: dict[tuple[int, int], DeferredWeightGrad] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # micro-batch -> detached loss
    in_flight: int = 0
    max_in_flight: int = 0

    def message_in(self, action: Action) -> torch.Tensor | None:
        need = needed_message(action, self.state.pp_rank, self.state.pp_size, len(self.chunks), self.v_shape)
        return None if need is None else self.comm.take(need[1])

    def message_out(self, action: Action, tensor: torch.Tensor) -> bool:
        out = produced_message(action, self.state.pp_rank, self.state.pp_size, len(self.chunks), self.v_shape)
        if out is None:
            return False
        if out[0] == self.state.pp_rank:  # the turn of the V: this rank's other chunk takes it
            self.comm.deliver_local(out[1], tensor)
        else:
            self.comm.put(out[1], tensor)
        return True

    def forward(self, action: Action) -> None:
        input_tensor = self.message_in(action)
        if input_tensor is not None and not self.forward_only:
            input_tensor.requires_grad_()
        chunk = self.chunks[action.chunk]
        output = self.forward_fn(action.chunk, chunk, input_tensor, self.microbatches[action.microbatch])
        if not self.message_out(action, output):
            self.losses[action.microbatch] = output.detach()  # the loss of the last virtual stage
        elif not self.forward_only:
            deallocate_output(output)  # sent: only its graph is needed from here on
        if self.forward_only:
            return
        self.held[(action.microbatch, action.chunk)] = (input_tensor, output)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _output_grad(self, action: Action) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(input, output, gradient of the output) of the held forward of `action`."""
        input_tensor, output = self.held.pop((action.microbatch, action.chunk))
        grad = self.message_in(action)
        if grad is None:  # last virtual stage: start from the (scaled) loss
            grad = torch.full_like(output, self.loss_scale)
        return input_tensor, output, grad

    def _send_input_grad(self, action: Action, input_tensor: torch.Tensor | None, grad: torch.Tensor | None) -> None:
        if input_tensor is not None:
            if grad is None:  # the chunk ignored its input
                grad = torch.zeros_like(input_tensor)
            self.message_out(action, grad)

    def backward(self, action: Action) -> None:
        """The whole backward: input and weight gradients."""
        input_tensor, output, grad = self._output_grad(action)
        run_backward(output, grad)
        self._send_input_grad(action, input_tensor, None if input_tensor is None else input_tensor.grad)
        self.in_flight -= 1

    def backward_input(self, action: Action) -> None:
        """The input gradient only; the weight gradients wait for the WEIGHT action (weight_grad.py)."""
        input_tensor, output, grad = self._output_grad(action)
        params = list(self.chunks[action.chunk].parameters())
        input_grad, deferred = backward_input(output, grad, input_tensor, params)
        self.deferred[(action.microbatch, action.chunk)] = deferred
        self._send_input_grad(action, input_tensor, input_grad)

    def weight(self, action: Action) -> None:
        """The deferred weight gradients; the micro-batch's activations are released here."""
        self.deferred.pop((action.microbatch, action.chunk)).run()
        self.in_flight -= 1


def execute_schedule(
    plan: PipelinePlan,
    chunks: Sequence[torch.nn.Module],
    microbatches: list[MicrobatchT],
    forward_fn: ForwardFn[MicrobatchT],
    state: ParallelState,
    activation_shape: tuple[int, ...],
    activation_dtype: torch.dtype,
    *,
    scatter_gather: bool,
    overlap_p2p_comm: bool,
    loss_scale: float = 1.0,
    on_last_backward: Callable[[int], None] | None = None,
) -> ScheduleResult:
    """Run this rank's plan for one iteration; see the module docstring and ScheduleResult.
    `scatter_gather` and `overlap_p2p_comm` are parallel.scatter_gather (off under sequence parallelism)
    and parallel.overlap_p2p_comm.

    `forward_fn` (ForwardFn) returns the chunk output, or on the last virtual stage the scalar loss.
    A forward-only plan (evaluation) runs under no_grad and holds nothing for backward.
    `on_last_backward(chunk_index)` is called just before the last action that makes weight gradients of
    each chunk (its last backward, or its last WEIGHT under a zero-bubble schedule).
    With `overlap_p2p_comm` a step's batch stays in flight while the step's action computes, unless the
    action needs a tensor that batch receives (Megatron's overlap_p2p_comm); each batch still completes
    before the next is posted, so the NCCL-safe order of the plan is kept and the numbers are the same.
    """
    forward_only = plan.forward_only
    params = [p for chunk in chunks for p in chunk.parameters()]
    device = params[0].device if params else torch.device("cpu")
    comm = StageComm(state, activation_shape, activation_dtype, device, scatter_gather)
    run = _Run(chunks, microbatches, forward_fn, state, comm, loss_scale, forward_only, plan.v_shape)
    in_flight = None
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        for index, step in enumerate(plan.steps):
            comm.complete(in_flight)  # the previous batch, if it was left in flight
            in_flight = comm.post(step)
            if step.compute is None:
                continue
            if not overlap_p2p_comm or index in plan.needs_own_batch:
                comm.complete(in_flight)
                in_flight = None
            action = plan.actions[step.compute]
            match action.op:
                case Op.FORWARD:
                    run.forward(action)
                case Op.BACKWARD | Op.WEIGHT:
                    if on_last_backward is not None and step.compute in plan.last_backward_indices:
                        on_last_backward(action.chunk)
                    if action.op is Op.WEIGHT:
                        run.weight(action)
                    else:
                        run.backward(action)
                case Op.BACKWARD_INPUT:
                    run.backward_input(action)
                case _:
                    unhandled_op(action.op)
        comm.complete(in_flight)
    comm.finish()
    losses = [run.losses[i] for i in sorted(run.losses)]
    return ScheduleResult(losses=losses, max_in_flight=run.max_in_flight)
