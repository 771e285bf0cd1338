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
all-gather's output, a reduce-scatter's input, the tensor otherwise), a sequence number (collectives numbered per
group, so one call has the same number on every member; sends and receives per peer, so the n-th send to a peer
is the peer's n-th receive from this rank), the peer of a send/recv, and what the loop was doing (`region`: "startup", "boundary", "train", "eval",
"checkpoint", "report") and in which iteration (labels are per thread: an async checkpoint's thread labels its
own), and whether this rank is still waiting in it, completed it or saw it fail, with the seconds it was blocked.
The recorder keeps a bounded ring of the latest records and the latest one per group (and per p2p peer): cheap
enough to be always on (one small object, a deque append and two clock reads per call); with `keep_all` every
record (tests). planner/collectives.py lists what the planner charges per iteration; tests compare the two
exactly. A hang report (operations/diagnostics.py) dumps them; tools/diagnose_hang.py compares the ranks' dumps.

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
import itertools
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

from compat import torch_private

GatheredT = TypeVar("GatheredT")  # what all_gather_object gathers
WORLD = "world"
P2P_KINDS = ("send", "recv")
# What this rank has done with a call: issued it (an async one in flight), is blocked in it, saw it complete or
# fail; "noted": issued by someone else (FSDP), its completion is not seen here.
ENTERED, WAITING, COMPLETED, FAILED, NOTED = "entered", "waiting", "completed", "failed", "noted"


@dataclass
class CommRecord:
    """One collective or one send/recv as issued by this rank."""

    seq: int  # collectives: n-th on `group` (same on every member); send/recv: n-th to / from `peer` on `group`
    group: str  # "tp", "cp", "dp", "dp_cp", "pp", "embedding", "tp_pp", "world", HSDP's "dp_shard", "dp_replicate", or a name given to `register`
    group_size: int
    kind: str  # all_reduce, all_gather, reduce_scatter, broadcast, send, recv, barrier, all_gather_object
    nbytes: int  # the full buffer (see the module docstring)
    iteration: int  # the iteration the loop was in (-1 before training)
    region: str  # what the loop was doing: startup, boundary, train, eval, checkpoint, report
    peer: int = -1  # send / recv: the peer's global rank
    order: int = 0  # this rank's n-th record on any group: the order it issued them in
    state: str = ENTERED  # entered, waiting, completed, failed, noted (see above)
    started: float = 0.0  # wall-clock time (time.time()) it was issued
    wait_s: float = 0.0  # seconds this rank was blocked in it (the call itself, or the wait() of an async one)
    error: str = ""  # torch's error, when it failed


class _ThreadState(threading.local):
    """Per thread: the loop's labels, the seconds spent blocked in calls and when the last one returned."""

    def __init__(self) -> None:
        self.region, self.iteration = "startup", -1
        self.wait_seconds = 0.0
        self.last_return = time.perf_counter()


def _seq_key(group: str, kind: str, peer: int) -> tuple[str, str, int]:
    return (group, kind, peer) if kind in P2P_KINDS else (group, "", -1)


class CommRecorder:
    """Records of one rank: a ring of the `capacity` latest (a flight recorder), the latest per group (and per
    p2p peer and direction), and with `keep_all` every record."""

    def __init__(self, capacity: int = 1024, keep_all: bool = False):
        self.recent: deque[CommRecord] = deque(maxlen=capacity)
        self.history: list[CommRecord] | None = [] if keep_all else None
        self.latest: dict[tuple[str, str, int], CommRecord] = {}
        self.activity = 0  # grows with every record made or finished: the watchdog's sign of progress
        self._seq: dict[tuple[str, str, int], int] = {}
        self._order = itertools.count()
        self._thread = _ThreadState()
        self._lock = threading.Lock()  # the training loop and an async checkpoint's thread both record

    @property
    def region(self) -> str:
        """What the calling thread's loop is doing (see `during`)."""
        return self._thread.region

    @property
    def iteration(self) -> int:
        return self._thread.iteration

    @property
    def wait_seconds(self) -> float:
        """Seconds the calling thread has been blocked in recorded calls, in all."""
        return self._thread.wait_seconds

    @property
    def last_return(self) -> float:
        """time.perf_counter() when the calling thread's last recorded call returned."""
        return self._thread.last_return

    def record(
        self, group: str, group_size: int, kind: str, nbytes: int, peer: int = -1, state: str = ENTERED
    ) -> CommRecord:
        labels, key = self._thread, _seq_key(group, kind, peer)
        with self._lock:
            seq = self._seq.get(key, 0)
            self._seq[key] = seq + 1
            entry = CommRecord(
                seq, group, group_size, kind, nbytes, labels.iteration, labels.region, peer, next(self._order), state
            )
            entry.started = time.time()
            self.latest[key] = entry
            self.recent.append(entry)
            if self.history is not None:
                self.history.append(entry)
            self.activity += 1
        return entry

    def finish(self, entry: CommRecord, blocked_since: float, error: BaseException | None = None) -> None:
        """`entry` completed (or failed with `error`) after blocking this thread since `blocked_since`."""
        now = time.perf_counter()
        entry.wait_s += now - blocked_since
        entry.state = COMPLETED if error is None else FAILED
        if error is not None:
            entry.error = _first_line(error)
        self._thread.wait_seconds += now - blocked_since
        self._thread.last_return = now
        self.activity += 1

    @contextlib.contextmanager
    def during(self, region: str, iteration: int | None = None) -> Iterator[None]:
        """Label the calling thread's records made inside the block (the previous labels come back after it)."""
        labels = self._thread
        before = labels.region, labels.iteration
        labels.region = region
        labels.iteration = before[1] if iteration is None else iteration
        try:
            yield
        finally:
            labels.region, labels.iteration = before

    def records(self, region: str | None = None, iteration: int | None = None) -> list[CommRecord]:
        """Every record (keep_all) of `region` and `iteration` (None: any)."""
        if self.history is None:
            raise ValueError("this recorder keeps only its latest records: build it with keep_all=True")
        return [
            r
            for r in self.history
            if (region is None or r.region == region) and (iteration is None or r.iteration == iteration)
        ]

    def dump(self) -> list[dict[str, str | int | float]]:
        """The ring's records and the latest of each group and peer, in the order issued, as plain dicts."""
        with self._lock:
            kept = {r.order: r for r in self.recent}
            kept.update((r.order, r) for r in self.latest.values())
            return [asdict(kept[order]) for order in sorted(kept)]


class CollectiveError(RuntimeError):
    """A collective or transfer that raised (a timeout, a peer gone): the message names the call; torch's error
    is the cause; `record` is this rank's record of it (None without a recorder)."""

    def __init__(self, message: str, record: CommRecord | None = None):
        super().__init__(message)
        self.record = record


def _first_line(error: BaseException) -> str:
    """torch's message, its first sentence, without gloo's source location ("[.../pair.cc:553] Connection
    closed by peer [10.0.0.2]:41354. This is typically caused by ..." -> "Connection closed by peer ...")."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return re.sub(r"^\[[^\]]*\]\s*", "", lines[0]).split(". ")[0]


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
            return CollectiveError(f"a collective {what} failed after {seconds:.1f} s: {_first_line(error)}")
        peer = f", peer rank {entry.peer}" if entry.kind in P2P_KINDS else ""
        return CollectiveError(
            f"{entry.kind} #{entry.seq} on group {entry.group} ({entry.group_size} ranks{peer}, {entry.nbytes} B, "
            f"iteration {entry.iteration}, {entry.region}) failed after {seconds:.1f} s: {_first_line(error)}",
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
