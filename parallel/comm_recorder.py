"""What one rank's collectives were: `CommRecorder`, a per-rank flight recorder of the calls that go through the
door (parallel/comm.py's `Collectives`), and `CommRecord`, one call as this rank issued it.

Each record holds the kind, the group's name and size, the bytes (the full buffer: an all-gather's output, a
reduce-scatter's input, the tensor otherwise; 0 for object collectives, whose size is unknown before pickling), a
sequence number (collectives numbered per group, so one call has the same number on every member; sends and
receives per peer, so the n-th send to a peer is the peer's n-th receive from this rank), the peer of a send/recv,
and what the loop was doing (`region`: "startup", "boundary", "train", "eval", "checkpoint", "report") and in which
iteration (labels are per thread: an async checkpoint's thread labels its own), and whether this rank is still
waiting in it, completed it or saw it fail, with the seconds it was blocked.

The recorder keeps a bounded ring of the latest records and the latest one per group (and per p2p peer): cheap
enough to be always on (one small object, a deque append and two clock reads per call); with `keep_all` every
record (tests). planner/collectives.py lists what the planner charges per iteration; tests compare the two
exactly. A hang report (training/diagnostics.py) dumps them; tools/diagnose_hang.py compares the ranks' dumps.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass

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
    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv, barrier, all_gather_object, broadcast_object_list
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
            entry.error = first_line(error)
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


def first_line(error: BaseException) -> str:
    """torch's message, its first sentence, without gloo's source location ("[.../pair.cc:553] Connection
    closed by peer [10.0.0.2]:41354. This is typically caused by ..." -> "Connection closed by peer ...")."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return re.sub(r"^\[[^\]]*\]\s*", "", lines[0]).split(". ")[0]
