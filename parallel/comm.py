"""The one door for the collectives and point-to-point transfers the trainer issues: `Collectives`, with an
optional per-rank `CommRecorder` that sees each of them.

`ParallelState` holds one `Collectives` (`state.comm`) and names every process group it creates there by the
dimensions it spans: "tp", "cp", "dp", "dp_cp" (the gradient replicas with context parallelism), "pp",
"embedding" (the ranks holding tied-embedding copies), "tp_pp" (the model-parallel group of the grad norm);
the default group is "world". Every collective of parallel/ and training/'s step goes through its methods
(tp regions, ring attention, pipeline batches and their scatter/gather, gradient buckets, the tied embedding,
sequence-parallel grads, the grad norm, the inf check, the distributed optimizer's gathers, the loss), so a
recorder attached to it sees everything an iteration sends.

Each record (`CommRecord`) holds the kind, the group's name and size, the bytes (the full buffer: an
all-gather's output, a reduce-scatter's input, the tensor otherwise), this rank's sequence number on that group,
the peer of a send/recv, and what the loop was doing (`region`: "startup", "boundary", "train", "eval",
"checkpoint") and in which iteration. The recorder keeps a bounded ring of the latest records (cheap enough to
be always on: one small object and a deque append per call), and with `keep_all` every record (tests).
planner/collectives.py lists what the planner charges per iteration; tests compare the two exactly.

Collectives issued by torch itself (FSDP2's all-gathers and reduce-scatters) can be recorded without being
issued here: `Collectives.note(kind, nbytes, group)` records one call on a registered group, which is what an
FSDP `set_custom_all_gather` / `set_custom_reduce_scatter` hook calling `all_gather_into` /
`reduce_scatter_into` would do for free.

Compatibility: torch 2.13 deprecates `all_gather_into_tensor` / `reduce_scatter_tensor` in favour of
`all_gather_single` / `reduce_scatter_single`, while torch 2.11 (the GPU machine) may lack the new names;
`_gather_into` / `_scatter_into` pick whichever exists.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

WORLD = "world"


@dataclass(frozen=True)
class CommRecord:
    """One collective or one send/recv as issued by this rank."""

    seq: int  # this rank's n-th call on `group` (from 0): the key to match ranks' records of one group
    group: str  # "tp", "cp", "dp", "dp_cp", "pp", "embedding", "tp_pp", "world", or a name given to `register`
    group_size: int
    kind: str  # all_reduce, all_gather, reduce_scatter, broadcast, send, recv, barrier, all_gather_object
    nbytes: int  # the full buffer (see the module docstring)
    iteration: int  # the iteration the loop was in (-1 before training)
    region: str  # what the loop was doing: startup, boundary, train, eval, checkpoint
    peer: int = -1  # send / recv: the peer's global rank


class CommRecorder:
    """Records of one rank: a ring of the `capacity` latest (a flight recorder) and, with `keep_all`, all."""

    def __init__(self, capacity: int = 1024, keep_all: bool = False):
        self.recent: deque[CommRecord] = deque(maxlen=capacity)
        self.history: list[CommRecord] | None = [] if keep_all else None
        self.region, self.iteration = "startup", -1
        self._seq: dict[str, int] = {}

    def record(self, group: str, group_size: int, kind: str, nbytes: int, peer: int = -1) -> CommRecord:
        seq = self._seq.get(group, 0)
        self._seq[group] = seq + 1
        entry = CommRecord(seq, group, group_size, kind, nbytes, self.iteration, self.region, peer)
        self.recent.append(entry)
        if self.history is not None:
            self.history.append(entry)
        return entry

    @contextlib.contextmanager
    def during(self, region: str, iteration: int | None = None) -> Iterator[None]:
        """Label the records made inside the block (the previous labels come back after it)."""
        before = self.region, self.iteration
        self.region = region
        self.iteration = before[1] if iteration is None else iteration
        try:
            yield
        finally:
            self.region, self.iteration = before

    def records(self, region: str | None = None, iteration: int | None = None) -> list[CommRecord]:
        """Every record (keep_all) of `region` and `iteration` (None: any)."""
        if self.history is None:
            raise ValueError("this recorder keeps only its latest records: build it with keep_all=True")
        return [
            r
            for r in self.history
            if (region is None or r.region == region) and (iteration is None or r.iteration == iteration)
        ]

    def dump(self) -> list[dict[str, Any]]:
        """The ring's records, oldest first, as plain dicts (JSON-ready)."""
        return [asdict(r) for r in self.recent]


class P2P(NamedTuple):
    """One operation of a batch of sends and receives: `peer` is a global rank."""

    kind: str  # "send" | "recv"
    tensor: torch.Tensor
    peer: int
    group: Any


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _gather_into(output: torch.Tensor, input_: torch.Tensor, group: Any, async_op: bool) -> Any:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input_, group=group, async_op=async_op)


def _scatter_into(output: torch.Tensor, input_: torch.Tensor, group: Any, async_op: bool) -> Any:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input_, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class Collectives:
    """Issues collectives and p2p on named process groups and reports each to the recorder, if any."""

    def __init__(self, recorder: CommRecorder | None = None):
        self.recorder = recorder
        self._names: dict[int, tuple[str, int]] = {}  # id(process group) -> (name, size)

    def register(self, group: Any, name: str, size: int) -> None:
        """Name `group` (a process group of `size` ranks) in the records."""
        self._names[id(group)] = (name, size)

    def _named(self, group: Any) -> tuple[str, int]:
        if group is None or group is dist.group.WORLD:
            return WORLD, dist.get_world_size()
        return self._names.get(id(group)) or ("unnamed", dist.get_world_size(group))

    def note(self, kind: str, nbytes: int, group: Any = None, peer: int = -1) -> None:
        """Record one call of `kind` on `group` that someone else issues (e.g. torch's FSDP)."""
        if self.recorder is not None:
            name, size = self._named(group)
            self.recorder.record(name, size, kind, nbytes, peer)

    def region(self, name: str, iteration: int | None = None) -> contextlib.AbstractContextManager[None]:
        """Label what the loop does next in the records (no-op without a recorder)."""
        return self.recorder.during(name, iteration) if self.recorder is not None else contextlib.nullcontext()

    # ---- collectives ---------------------------------------------------------------------------------
    def all_reduce(
        self, tensor: torch.Tensor, group: Any = None, op: Any = dist.ReduceOp.SUM, async_op: bool = False
    ) -> Any:
        """Reduce `tensor` over `group` in place (op: SUM, MAX, MIN)."""
        self.note("all_reduce", _nbytes(tensor), group)
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def all_gather_into(
        self, output: torch.Tensor, input_: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any:
        """Concatenate every rank's `input_` along dim 0 into `output` (group size x input rows)."""
        self.note("all_gather", _nbytes(output), group)
        return _gather_into(output, input_, group, async_op)

    def reduce_scatter_into(
        self, output: torch.Tensor, input_: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any:
        """Sum `input_` over ranks and keep this rank's dim-0 slice (input rows / group size) in `output`."""
        self.note("reduce_scatter", _nbytes(input_), group)
        return _scatter_into(output, input_, group, async_op)

    def all_gather(self, outputs: list[torch.Tensor], input_: torch.Tensor, group: Any = None) -> Any:
        """Every rank's `input_` into the list `outputs` (one tensor per rank)."""
        self.note("all_gather", sum(_nbytes(t) for t in outputs), group)
        return dist.all_gather(outputs, input_, group=group)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None) -> Any:
        self.note("broadcast", _nbytes(tensor), group)
        return dist.broadcast(tensor, src=src, group=group)

    def barrier(self, group: Any = None) -> Any:
        self.note("barrier", 0, group)
        return dist.barrier(group=group)

    def all_gather_object(self, outputs: list[Any], obj: Any, group: Any = None) -> None:
        """Every rank's picklable `obj` into `outputs` (bytes unknown before pickling: recorded as 0)."""
        self.note("all_gather_object", 0, group)
        dist.all_gather_object(outputs, obj, group=group)

    # ---- point to point ------------------------------------------------------------------------------
    def batch_isend_irecv(self, ops: Sequence[P2P]) -> list[Any]:
        """Post `ops` as one batch (NCCL-safe order is the caller's); returns the works to wait on."""
        p2p_ops = []
        for op in ops:
            self.note(op.kind, _nbytes(op.tensor), op.group, op.peer)
            issue = dist.isend if op.kind == "send" else dist.irecv
            p2p_ops.append(dist.P2POp(issue, op.tensor, op.peer, op.group))
        return dist.batch_isend_irecv(p2p_ops) if p2p_ops else []
