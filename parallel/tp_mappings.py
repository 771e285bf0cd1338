"""Communication in and out of tensor-parallel regions, as autograd functions (Megatron's `mappings.py`).

Each function is a pair of conjugate collectives: what forward does, backward undoes on the gradient.

    copy_to_tp_region                      fwd identity            bwd all-reduce
    reduce_from_tp_region                  fwd all-reduce          bwd identity
    scatter_to_tp_region                   fwd split last dim      bwd all-gather last dim
    gather_from_tp_region                  fwd all-gather last dim bwd split last dim
    scatter_to_sequence_parallel_region    fwd split dim 0 (s)     bwd all-gather dim 0
    gather_from_sequence_parallel_region   fwd all-gather dim 0    bwd reduce-scatter dim 0
    reduce_scatter_to_sequence_parallel_region
                                           fwd reduce-scatter dim 0 bwd all-gather dim 0

A `TPComm` carries what a collective needs (group, rank, size, and the state's `Collectives`, through which
every collective is issued: parallel/comm.py) plus an optional `CommCounter` and a scope label ("layer",
"embedding", "output", "loss") so the per-transformer-layer count can be checked apart.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from parallel.comm import Collectives


class CommCounter:
    """Counts tensor-parallel collectives by (scope, kind, phase); phase is "forward" or "backward".

    A plain object owned by whoever wants the numbers (the trainer logs `summary()` after the first
    iteration). Recomputation (activation checkpointing) repeats forward collectives during backward; they
    are counted as "forward", which is what they are.
    """

    def __init__(self, compiled: bool = False) -> None:
        """`compiled`: the layers counting here run under torch.compile (train.compile=true)."""
        self.counts: dict[tuple[str, str, str], int] = defaultdict(int)
        self.bytes: dict[tuple[str, str, str], int] = defaultdict(int)
        # Under torch.compile, dynamo traced the increments below into each compiled frame and guarded on the
        # dicts' sizes and int values: every count changed a guard, so the layers recompiled on every call until
        # dynamo's recompile limit sent them back to eager. torch.compiler.disable runs counting and the
        # collective together outside the trace, at the one graph break the collective already makes (the
        # Collectives door takes a lock and reads clocks, which dynamo cannot trace): no extra graph, no guard
        # on the counts, and every call counted when it runs. Disabling `record` alone would add a second break
        # (a resume function to compile) between the count and the collective. Only with `compiled`: building
        # the wrapper imports torch._dynamo (~1 CPU s), which an eager run need not pay.
        self.count_and_issue: Callable[..., None] = (
            torch.compiler.disable(self._count_and_issue) if compiled else self._count_and_issue
        )

    def record(self, scope: str, kind: str, phase: str, tensor: torch.Tensor) -> None:
        key = (scope, kind, phase)
        self.counts[key] += 1
        self.bytes[key] += tensor.numel() * tensor.element_size()

    def _count_and_issue(
        self, scope: str, kind: str, phase: str, counted: torch.Tensor, collective: Callable[..., object], *args: object
    ) -> None:
        """Record one call of `kind` on `counted`, then issue it: `collective(*args)`."""
        self.record(scope, kind, phase, counted)
        collective(*args)

    def count(self, kind: str, phase: str, scope: str | None = "layer") -> int:
        """Calls of `kind` in `phase` within `scope` (None: all scopes)."""
        return sum(
            n for (s, k, p), n in self.counts.items() if k == kind and p == phase and (scope is None or s == scope)
        )

    def reset(self) -> None:
        self.counts.clear()
        self.bytes.clear()

    def summary(self, num_layers: int | None = None, num_microbatches: int = 1) -> str:
        """One line per (scope, kind, phase); with `num_layers`, layer counts also per layer per micro-batch."""
        lines = []
        for (scope, kind, phase), n in sorted(self.counts.items()):
            mib = self.bytes[(scope, kind, phase)] / 2**20
            line = f"tp comm {scope:9s} {kind:14s} {phase:8s} {n:6d} calls {mib:10.3f} MiB"
            if scope == "layer" and num_layers:
                line += f"  ({n / (num_layers * num_microbatches):g} per layer per micro-batch)"
            lines.append(line)
        return "\n".join(lines) if lines else "tp comm: none recorded"


@dataclass(frozen=True)
class TPComm:
    """The tensor-parallel group as seen by one rank, plus where to count its collectives."""

    group: ProcessGroup | None
    rank: int
    size: int
    counter: CommCounter | None = None
    scope: str = "layer"
    collectives: Collectives = field(default_factory=Collectives)  # the state's door (records every call)

    def with_scope(self, scope: str) -> TPComm:
        return replace(self, scope=scope)


def _issue_uncounted(
    scope: str, kind: str, phase: str, counted: torch.Tensor, collective: Callable[..., object], *args: object
) -> None:
    collective(*args)


def _issuer(comm: TPComm) -> Callable[..., None]:
    """What issues `comm`'s collectives: f(scope, kind, phase, counted, collective, *args) runs `collective(*args)`,
    counted by the counter if any. The raw collectives below call it themselves: under torch.compile dynamo then
    breaks the graph in their frame, where a wrapper method would be one more frame for it to compile."""
    return comm.counter.count_and_issue if comm.counter is not None else _issue_uncounted


# ---- the raw collectives (no autograd) ------------------------------------------------------------
def all_reduce(
    x: torch.Tensor, comm: TPComm, phase: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.Tensor:
    """All-reduce over the tp group, in place when x is contiguous (returns the reduced tensor)."""
    if comm.size == 1:
        return x
    x = x.contiguous()
    _issuer(comm)(comm.scope, "all_reduce", phase, x, comm.collectives.all_reduce, x, comm.group, op)
    return x


def _split_last(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    if comm.size == 1:
        return x
    return x.chunk(comm.size, dim=-1)[comm.rank].contiguous()


def _gather_last(x: torch.Tensor, comm: TPComm, phase: str) -> torch.Tensor:
    if comm.size == 1:
        return x
    # Gather along dim 0 (contiguous), then move each rank's block next to the last dim. The output's dim 0 is
    # size x the input's (not a new rank axis): gloo checks each rank's slice of it against the input's shape.
    out = torch.empty((x.shape[0] * comm.size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    issue = _issuer(comm)
    issue(comm.scope, "all_gather", phase, x, comm.collectives.all_gather_into, out, x.contiguous(), comm.group)
    return torch.cat(out.chunk(comm.size, dim=0), dim=-1)


def _split_first(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    if comm.size == 1:
        return x
    if x.shape[0] % comm.size:
        raise ValueError(
            f"sequence parallelism: sequence length {x.shape[0]} is not divisible by parallel.tp_size={comm.size}"
        )
    return x.chunk(comm.size, dim=0)[comm.rank].contiguous()


def _gather_first(x: torch.Tensor, comm: TPComm, phase: str) -> torch.Tensor:
    if comm.size == 1:
        return x
    out = torch.empty((x.shape[0] * comm.size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    issue = _issuer(comm)
    issue(comm.scope, "all_gather", phase, x, comm.collectives.all_gather_into, out, x.contiguous(), comm.group)
    return out


def _reduce_scatter_first(x: torch.Tensor, comm: TPComm, phase: str) -> torch.Tensor:
    if comm.size == 1:
        return x
    if x.shape[0] % comm.size:
        raise ValueError(
            f"sequence parallelism: sequence length {x.shape[0]} is not divisible by parallel.tp_size={comm.size}"
        )
    out = torch.empty((x.shape[0] // comm.size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    issue = _issuer(comm)
    issue(comm.scope, "reduce_scatter", phase, x, comm.collectives.reduce_scatter_into, out, x.contiguous(), comm.group)
    return out


# ---- autograd functions ---------------------------------------------------------------------------
# Adjoint twin of _ReduceFromTP (identity forward, all-reduce backward; the other the reverse).
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.comm, "backward"), None


# Adjoint twin of _CopyToTP.
class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        # In place, as Megatron: x is a fresh matmul output that nothing saved for backward.
        return all_reduce(x, comm, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# Adjoint twin of _GatherFromTP (split / all-gather along h, swapped in backward); _ScatterToSP is the
# same pair along s. The four stay separate classes: each is one conjugate pair of Megatron's mappings.
class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _split_last(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.comm, "backward"), None


# Adjoint twin of _ScatterToTP: all-gather along h forward, keep this rank's slice backward.
class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_last(x, comm, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.comm), None


# Twin of _ScatterToTP along s instead of h (adjoint: _GatherFromSP without tp_output_grad).
class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _split_first(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.comm, "backward"), None


# Adjoint twin of _ScatterToSP, or of _ReduceScatterToSP when its consumer is tp-parallel.
class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, tensor_parallel_output_grad):
        ctx.comm, ctx.tp_output_grad = comm, tensor_parallel_output_grad
        return _gather_first(x, comm, "forward")

    @staticmethod
    def backward(ctx, grad):
        # If the consumer is a tp-parallel op, each rank holds a partial gradient: sum and keep our rows.
        if ctx.tp_output_grad:
            return _reduce_scatter_first(grad, ctx.comm, "backward"), None, None
        return _split_first(grad, ctx.comm), None, None


# Adjoint twin of _GatherFromSP (reduce-scatter along s forward, all-gather backward); same shape as
# _ScatterToSP, with the sum in place of the split.
class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter_first(x, comm, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.comm, "backward"), None


def copy_to_tp_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _CopyToTP.apply(x, comm)


def reduce_from_tp_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _ReduceFromTP.apply(x, comm)


def scatter_to_tp_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _ScatterToTP.apply(x, comm)


def gather_from_tp_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _GatherFromTP.apply(x, comm)


def scatter_to_sequence_parallel_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _ScatterToSP.apply(x, comm)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, comm: TPComm, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    return _GatherFromSP.apply(x, comm, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _ReduceScatterToSP.apply(x, comm)
