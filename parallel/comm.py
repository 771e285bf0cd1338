"""The one door for the collectives and point-to-point transfers the trainer and its tools issue: `Collectives`,
with an optional per-rank `CommRecorder` (parallel/comm_recorder.py) that sees each of them.

`ParallelState` holds one `Collectives` (`state.comm`) and names every process group it creates there by the
dimensions it spans: "tp", "cp", "dp", "dp_cp" (the gradient replicas with context parallelism), "pp",
"embedding" (the ranks holding tied-embedding copies), "tp_pp" (the model-parallel group of the grad norm),
"ep" and "expert_dp" (expert parallelism: the MoE token all-to-all, the expert gradients' reduction); the
default group is "world". Every collective of parallel/ and training/'s step goes through its methods
(tp regions, ring attention, pipeline batches and their scatter/gather, gradient buckets, the tied embedding,
sequence-parallel grads, the grad norm, the inf check, the distributed optimizer's gathers, the loss), and so
does every other collective of the code base (the run lock, checkpoint verification and saves, start-up
barriers, evaluation, generation; tests/parallel/test_comm_door.py fails on a raw torch.distributed call
elsewhere), so a recorder attached to it sees everything a rank sends.

Every call is reported to the recorder, if any (parallel/comm_recorder.py: `CommRecorder`, one `CommRecord` per
call, with what it holds), before it is issued and again when it returns or fails. Before a `ParallelState`
exists, the start-up's collectives (the run lock's all-reduce, the data barriers) go through the world's door,
`DistEnv.comm` (operations/startup.py), whose recorder the state's door then shares: one rank's records in one ring.

Timeouts: `Collectives.set_timeout` changes the timeout of the named groups' future calls (operations/watchdog.py:
parallel.init_timeout_s, then parallel.train_timeout_s after the first step). On gloo a receive's wait() has no
timeout of its own, so the works returned here pass the group's timeout to wait(); on NCCL that would block the
CPU until the GPU finishes, so they do not (NCCL's own watchdog bounds its collectives). A call that raises
(a timeout, a peer gone) raises `CollectiveError`, naming the call, with torch's error as its cause.

FSDP2's all-gathers and reduce-scatters come here too, through its custom collectives (parallel/fsdp.py:
`set_custom_all_gather` / `set_custom_reduce_scatter` call `all_gather_into` / `reduce_scatter_into`); what torch
issues by itself is recorded with `Collectives.note(kind, nbytes, group)` (HSDP's all-reduce, from FSDP's
all-reduce hook).

Compatibility: torch 2.13 deprecates `all_gather_into_tensor` / `reduce_scatter_tensor` in favour of
`all_gather_single` / `reduce_scatter_single`, while torch 2.11 (the GPU machine) may lack the new names;
`_gather_into` / `_scatter_into` pick whichever exists. `set_group_timeout` uses the public
`ProcessGroup.set_timeout` where it exists and else a private torch function (compat/torch_private.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

from compat import torch_private
from parallel.comm_recorder import (  # CommRecorder and P2P_KINDS also reach older importers through here
    ENTERED,
    NOTED,
    P2P_KINDS,
    WAITING,
    CommRecord,
    CommRecorder,
    first_line,
)

GatheredT = TypeVar("GatheredT")  # what all_gather_object gathers
WORLD = "world"


class CollectiveError(RuntimeError):
    """A collective or transfer that raised (a timeout, a peer gone): the message names the call; torch's error
    is the cause; `record` is this rank's record of it (None without a recorder)."""

    def __init__(self, message: str, record: CommRecord | None = None):
        super().__init__(message)
        self.record = record


class P2P(NamedTuple):
    """One operation of a batch of sends and receives: `peer` is a global rank."""

    kind: str  # "send" | "recv"
    tensor: torch.Tensor
    peer: int
    group: ProcessGroup | None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _gather_into(output: torch.Tensor, input_: torch.Tensor, group: ProcessGroup | None, async_op: bool) -> Work | None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input_, group=group, async_op=async_op)


def _scatter_into(
    output: torch.Tensor, input_: torch.Tensor, group: ProcessGroup | None, async_op: bool
) -> Work | None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input_, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def set_group_timeout(group: ProcessGroup | None, seconds: float) -> bool:
    """Make `seconds` the timeout of `group`'s future collectives (gloo and NCCL); False if torch cannot."""
    return torch_private.set_group_timeout(group, timedelta(seconds=seconds))


class RecordedWork:
    """A torch Work whose wait() marks its records completed (or failed) and counts the seconds blocked in it;
    on gloo the wait is bounded by the group's timeout (see the module docstring)."""

    def __init__(self, work: Work, records: Sequence[CommRecord | None], comm: Collectives, group: ProcessGroup | None):
        self._work, self._records, self._comm, self._group = work, records, comm, group

    def wait(self, timeout: timedelta | None = None) -> bool:
        recorder, records = self._comm.recorder, [r for r in self._records if r is not None]
        for entry in records:
            if entry.state == ENTERED:
                entry.state = WAITING
        timeout = timeout if timeout is not None else self._comm.wait_timeout(self._group)
        started = time.perf_counter()
        try:
            result = self._work.wait(timeout) if timeout is not None else self._work.wait()
        except Exception as err:
            if recorder is not None:
                for entry in records[1:]:
                    recorder.finish(entry, started, err)
            raise self._comm.failure(records[0] if records else None, started, err, "wait") from err
        if recorder is not None:
            for entry in records:
                if entry.state == WAITING:
                    recorder.finish(entry, started)
                    started = time.perf_counter()  # the batch's time is counted once
        return result

    def __getattr__(self, name: str) -> object:
        return getattr(self._work, name)


class Collectives:
    """Issues collectives and p2p on named process groups and reports each to the recorder, if any.

    `before_issue(kind, group_name, async_op)`, when set, runs before each call (a batch of sends and receives
    counts once, as kind "p2p") and may leave it out by returning False: the fault-injection test hook
    (operations/faults.py), off in every real run."""

    def __init__(self, recorder: CommRecorder | None = None):
        self.recorder = recorder
        self.before_issue: Callable[[str, str, bool], bool] | None = None
        self._names: dict[int, tuple[str, int]] = {}  # id(process group) -> (name, size)
        self._groups: dict[str, ProcessGroup] = {}  # name -> process group
        self._gloo_timeouts: dict[int, float] = {}  # id(gloo group) -> its timeout, for wait() (module docstring)

    def register(self, group: ProcessGroup, name: str, size: int) -> None:
        """Name `group` (a process group of `size` ranks) in the records."""
        self._names[id(group)] = (name, size)
        self._groups[name] = group

    def _named(self, group: ProcessGroup | None) -> tuple[str, int]:
        if group is None or group is dist.group.WORLD:
            return WORLD, dist.get_world_size()
        return self._names.get(id(group)) or ("unnamed", dist.get_world_size(group))

    def groups(self) -> dict[str, ProcessGroup | None]:
        """The named groups of this rank, the world included (when torch.distributed is up)."""
        world = {WORLD: dist.group.WORLD} if dist.is_available() and dist.is_initialized() else {}
        return {**world, **self._groups}

    def set_timeout(self, seconds: float, names: Sequence[str] | None = None) -> None:
        """The timeout of the future calls on the groups `names` (None: every group of `groups()`)."""
        for name, group in self.groups().items():
            if names is None or name in names:
                set_group_timeout(group, seconds)
                if dist.get_backend(group) == "gloo":
                    self._gloo_timeouts[id(group if group is not None else dist.group.WORLD)] = seconds

    def wait_timeout(self, group: ProcessGroup | None) -> timedelta | None:
        """What a wait() on `group`'s work passes as its timeout: the gloo group's, None elsewhere."""
        seconds = self._gloo_timeouts.get(id(group if group is not None else dist.group.WORLD))
        return timedelta(seconds=seconds) if seconds is not None else None

    def note(
        self, kind: str, nbytes: int, group: ProcessGroup | None = None, peer: int = -1, state: str = NOTED
    ) -> CommRecord | None:
        """Record one call of `kind` on `group` (by default one that someone else issues, e.g. torch's FSDP)."""
        if self.recorder is None:
            return None
        name, size = self._named(group)
        return self.recorder.record(name, size, kind, nbytes, peer, state)

    def region(self, name: str, iteration: int | None = None) -> contextlib.AbstractContextManager[None]:
        """Label what the loop does next in the records (no-op without a recorder)."""
        return self.recorder.during(name, iteration) if self.recorder is not None else contextlib.nullcontext()

    def failure(
        self, entry: CommRecord | None, started: float, error: BaseException, what: str = "call"
    ) -> CollectiveError:
        """Record that `entry` failed with `error` and return the one-line error naming it."""
        if self.recorder is not None and entry is not None:
            self.recorder.finish(entry, started, error)
        seconds = time.perf_counter() - started
        if entry is None:
            return CollectiveError(f"a collective {what} failed after {seconds:.1f} s: {first_line(error)}")
        peer = f", peer rank {entry.peer}" if entry.kind in P2P_KINDS else ""
        return CollectiveError(
            f"{entry.kind} #{entry.seq} on group {entry.group} ({entry.group_size} ranks{peer}, {entry.nbytes} B, "
            f"iteration {entry.iteration}, {entry.region}) failed after {seconds:.1f} s: {first_line(error)}",
            entry,
        )

    def _call(
        self,
        kind: str,
        nbytes: int,
        group: ProcessGroup | None,
        issue: Callable[[], Work | None],
        async_op: bool = False,
    ) -> RecordedWork | None:
        """Issue one collective through `issue()`: recorded, timed, its failure named."""
        if self.before_issue is not None and not self.before_issue(kind, self._named(group)[0], async_op):
            return None
        entry = self.note(kind, nbytes, group, state=ENTERED if async_op else WAITING)
        started = time.perf_counter()
        try:
            result = issue()
        except Exception as err:
            raise self.failure(entry, started, err) from err
        if async_op:
            assert result is not None, f"torch returned no work for an asynchronous {kind}"
            return RecordedWork(result, [entry], self, group)
        if entry is not None and self.recorder is not None:
            self.recorder.finish(entry, started)
        return None  # a blocking call: torch returns no work

    # ---- collectives ---------------------------------------------------------------------------------
    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: ProcessGroup | None = None,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> RecordedWork | None:
        """Reduce `tensor` over `group` in place (op: SUM, MAX, MIN)."""
        return self._call(
            "all_reduce",
            _nbytes(tensor),
            group,
            lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
            async_op,
        )

    def all_gather_into(
        self, output: torch.Tensor, input_: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
    ) -> RecordedWork | None:
        """Concatenate every rank's `input_` along dim 0 into `output` (group size x input rows)."""
        return self._call(
            "all_gather", _nbytes(output), group, lambda: _gather_into(output, input_, group, async_op), async_op
        )

    def reduce_scatter_into(
        self, output: torch.Tensor, input_: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
    ) -> RecordedWork | None:
        """Sum `input_` over ranks and keep this rank's dim-0 slice (input rows / group size) in `output`."""
        return self._call(
            "reduce_scatter", _nbytes(input_), group, lambda: _scatter_into(output, input_, group, async_op), async_op
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: ProcessGroup | None = None,
    ) -> None:
        """Send rows input_[sum(input_splits[:j]) : ...] to group rank j and receive output_splits[i] rows from
        group rank i into `output`, in group rank order (splits may be uneven; recorded bytes: what is sent)."""
        self._call(
            "all_to_all",
            _nbytes(input_),
            group,
            lambda: dist.all_to_all_single(output, input_, output_splits, input_splits, group=group),
        )

    def all_to_all(
        self, input_: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup | None
    ) -> torch.Tensor:
        """`all_to_all_single` into a new tensor, differentiable: its backward is the reverse all-to-all of the
        gradient (the splits swapped), through this door too. input_ [sum(input_splits), ...] ->
        [sum(output_splits), ...]."""
        return _AllToAll.apply(input_, output_splits, input_splits, group, self)

    def all_gather(self, outputs: list[torch.Tensor], input_: torch.Tensor, group: ProcessGroup | None = None) -> None:
        """Every rank's `input_` into the list `outputs` (one tensor per rank)."""
        nbytes = sum(_nbytes(t) for t in outputs)
        self._call("all_gather", nbytes, group, lambda: dist.all_gather(outputs, input_, group=group))

    def broadcast(self, tensor: torch.Tensor, src: int, group: ProcessGroup | None = None) -> None:
        self._call("broadcast", _nbytes(tensor), group, lambda: dist.broadcast(tensor, src=src, group=group))

    def barrier(self, group: ProcessGroup | None = None) -> None:
        self._call("barrier", 0, group, lambda: dist.barrier(group=group))

    def all_gather_object(
        self, outputs: list[GatheredT | None], obj: GatheredT, group: ProcessGroup | None = None
    ) -> None:
        """Every rank's picklable `obj` into `outputs` (placeholders, one per rank; bytes unknown before pickling:
        recorded as 0)."""
        self._call("all_gather_object", 0, group, lambda: dist.all_gather_object(outputs, obj, group=group))

    def broadcast_object_list(self, objects: list, src: int, group: ProcessGroup | None = None) -> None:
        """Global rank `src`'s picklable `objects` into every rank's list of the same length, in place (bytes
        unknown before pickling: recorded as 0)."""
        self._call("broadcast_object_list", 0, group, lambda: dist.broadcast_object_list(objects, src=src, group=group))

    # ---- point to point ------------------------------------------------------------------------------
    def batch_isend_irecv(self, ops: Sequence[P2P]) -> list[RecordedWork]:
        """Post `ops` as one batch (NCCL-safe order is the caller's); returns the works to wait on."""
        if not ops:
            return []
        if self.before_issue is not None:
            self.before_issue("p2p", self._named(ops[0].group)[0], True)
        entries, p2p_ops = [], []
        for op in ops:
            entries.append(self.note(op.kind, _nbytes(op.tensor), op.group, op.peer, state=ENTERED))
            issue = dist.isend if op.kind == "send" else dist.irecv
            p2p_ops.append(dist.P2POp(issue, op.tensor, op.peer, op.group))
        started = time.perf_counter()
        try:
            works = dist.batch_isend_irecv(p2p_ops)
        except Exception as err:
            raise self.failure(entries[0], started, err) from err
        if len(works) == len(ops):  # one work per operation (gloo)
            return [RecordedWork(w, [e], self, op.group) for w, e, op in zip(works, entries, ops)]
        return [RecordedWork(w, entries, self, ops[0].group) for w in works]  # coalesced (NCCL): one for all


class _AllToAll(torch.autograd.Function):
    """`Collectives.all_to_all` as an autograd function: each row goes to one rank and its gradient comes back
    from there, so backward is the all-to-all with input and output splits swapped."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        input_: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: ProcessGroup | None,
        comm: Collectives,
    ) -> torch.Tensor:
        ctx.exchange = (output_splits, input_splits, group, comm)  # type: ignore[attr-defined]
        input_ = input_.contiguous()
        output = input_.new_empty((sum(output_splits), *input_.shape[1:]))
        comm.all_to_all_single(output, input_, output_splits, input_splits, group)
        return output

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None, None]:
        output_splits, input_splits, group, comm = ctx.exchange  # type: ignore[attr-defined]
        grad = grad.contiguous()
        grad_input = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        comm.all_to_all_single(grad_input, grad, input_splits, output_splits, group)
        return grad_input, None, None, None, None
