"""Hangs on one rank: collective timeouts, a watchdog thread, and the dump and exit that follow either.

Timeouts. Every process group starts with parallel.init_timeout_s (start-up: creating the groups, building the
data, loading a checkpoint, compiling, the first iteration). After the first iteration of this process every rank
meets at one barrier (so no rank still busy with start-up work meets a shorter timeout) and the training groups
take parallel.train_timeout_s. The checkpoint group (checkpoint/saver.py) keeps the start-up timeout:
a save, sync or async, waits on that group only, so it never trips the training timeout.

Watchdog. A thread per rank (when there is more than one rank) watches for progress: a collective issued or
finished (parallel/comm.py's recorder counts them) or a new iteration. With none for the timeout in force plus
WATCHDOG_GRACE_S, it fires. That catches what no collective timeout can see: a rank stuck outside any collective
(a data loader that never returns, a stalled file system) while its peers wait for it. The grace lets a rank
blocked inside a collective report the collective's own timeout first. During a checkpoint save (`relaxed`) the
start-up timeout applies; a single process has no peers waiting for it and no watchdog.

Either way the rank writes its dump (operations/diagnostics.py: latest collectives, every thread's stack,
coordinates, iteration) and exits with EXIT_HUNG (operations/guards.py). A collective that raised unwinds the
normal way (run_training returns the code), with the watchdog as a backstop if that cleanup itself blocks; a
watchdog firing exits at once (os._exit: the main thread is stuck and cannot be unwound). The checkpoint in
progress, if any, stays an iter_N.tmp.<pid> folder that is never loaded; the last complete one stays the latest.
Every rank exits within about the timeout + WATCHDOG_GRACE_S of the stall: a peer blocked in a collective with
the stalled rank times out, one blocked with a peer that already exited fails at once ("connection closed").
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator

from operations.diagnostics import (
    RankIdentity,
    RunAttempt,
    agree_on_attempt,
    describe_rank,
    rank_identity,
    set_aside_previous,
    write_dump,
)
from operations.guards import EXIT_HUNG
from parallel.comm import CollectiveError
from parallel.state import ParallelState

WATCHDOG_GRACE_S = 5.0  # a rank blocked in a collective reports its timeout before its watchdog fires
EXIT_BACKSTOP_S = 15.0  # after a collective failed, the process is ended if its cleanup takes longer
CHECKPOINT_GROUP = "checkpoint"  # keeps the start-up timeout (module docstring)


class HangGuard:
    """One rank's timeouts, watchdog and hang report. `start(state)` once the parallel state exists; the loop
    calls `iteration_started`, `steady` after its first iteration, and `relaxed()` around checkpoint saves."""

    def __init__(self, init_timeout_s: float, train_timeout_s: float, run_dir: str, logger: logging.Logger):
        self.init_timeout_s, self.train_timeout_s = init_timeout_s, train_timeout_s
        self.run_dir, self.logger = run_dir, logger
        self.iteration = 0  # the iteration the loop is in (0: before the first)
        self.state: ParallelState | None = None
        self._identity: RankIdentity = {}
        self._attempt: RunAttempt | None = None  # agreed at start: which attempt the dumps belong to
        self._steady = False
        self._relaxed = 0
        self._beats = 0
        self._exit_by: float | None = None  # set once the rank is going down: the backstop's deadline
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the loop's side ----------------------------------------------------------------------------
    def start(self, state: ParallelState) -> None:
        """Apply the start-up timeout to every group and start the watchdog (more than one rank)."""
        self.state = state
        if not state.is_distributed:
            return
        if state.rank == 0:
            moved = set_aside_previous(self.run_dir)
            if moved:
                self.logger.info(f"an earlier attempt's hang diagnostics were moved to {moved}")
        state.comm.set_timeout(self.init_timeout_s)
        self._attempt = agree_on_attempt(state)
        self._identity = self._named_identity(state)
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()

    def iteration_started(self, iteration: int) -> None:
        self.iteration = iteration
        self._beats += 1

    def steady(self) -> None:
        """After this process's first iteration: one barrier, then the training timeout on the training groups."""
        state = self.state
        if self._steady or state is None or not state.is_distributed:
            return
        with state.comm.region("startup", self.iteration):
            state.comm.barrier()
        state.comm.set_timeout(self.train_timeout_s, [name for name in state.comm.groups() if name != CHECKPOINT_GROUP])
        self._steady = True
        self._beats += 1
        self.logger.info(
            f"collectives now time out after parallel.train_timeout_s={self.train_timeout_s:g} s "
            f"(checkpoint saves: parallel.init_timeout_s={self.init_timeout_s:g} s); "
            f"diagnostics on a hang: {os.path.join(self.run_dir, 'diagnostics')}"
        )

    @contextlib.contextmanager
    def relaxed(self) -> Iterator[None]:
        """Inside (a checkpoint save, joining an async one) the watchdog allows the start-up timeout."""
        self._relaxed += 1
        self._beats += 1
        try:
            yield
        finally:
            self._relaxed -= 1
            self._beats += 1

    def stop(self) -> None:
        """The run ended normally: the watchdog stops."""
        if self._exit_by is None:
            self._stop.set()

    @property
    def limit_s(self) -> float:
        """Seconds without progress after which the watchdog fires."""
        timeout = self.train_timeout_s if self._steady and not self._relaxed else self.init_timeout_s
        return timeout + WATCHDOG_GRACE_S

    # ---- on a hang ----------------------------------------------------------------------------------
    def collective_failed(self, error: CollectiveError) -> int:
        """A collective raised on the loop's thread: dump, say so in one line, return EXIT_HUNG (the watchdog
        ends the process if the cleanup after this blocks)."""
        if self.state is None or not self.state.is_distributed:
            print(f"error: {error}", file=sys.stderr, flush=True)
            return EXIT_HUNG
        timeout = self.train_timeout_s if self._steady else self.init_timeout_s
        key = "train_timeout_s" if self._steady else "init_timeout_s"
        self._exit_by = time.monotonic() + EXIT_BACKSTOP_S
        self._report("timeout", f"{error} (parallel.{key}={timeout:g})")
        return EXIT_HUNG

    def _named_identity(self, state: ParallelState) -> RankIdentity:
        """rank_identity with the attempt agreed at start (which run the dump belongs to)."""
        identity = rank_identity(state)
        if self._attempt is not None:
            identity["run"], identity["run_started"] = self._attempt["run"], self._attempt["run_started"]
        return identity

    def _report(self, cause: str, what: str) -> None:
        """Write the dump and the one-line error naming this rank, what happened and where the dump is."""
        state = self.state
        assert state is not None
        try:  # again: groups registered since the start (the checkpoint group) are named too
            identity = self._named_identity(state)
        except Exception:  # a dump must not fail on it: the start's will do
            identity = self._identity
        who = describe_rank(state.rank, identity["coords"])
        try:
            path = write_dump(self.run_dir, identity, cause, what, self.iteration, state.comm.recorder)
            where = f"diagnostics in {path}"
        except OSError as err:
            where = f"no diagnostics written ({err})"
        message = (
            f"error: {who} at iteration {self.iteration}: {what}; {where}; "
            f"run: python tools/diagnose_hang.py {self.run_dir}\n"
        )
        os.write(2, message.encode())  # not logging or print: the main thread may hold their locks

    def _watch(self) -> None:
        recorder = self.state.comm.recorder if self.state is not None else None
        seen, since = -1, time.monotonic()
        while not self._stop.wait(0.5):
            now = time.monotonic()
            if self._exit_by is not None:
                if now > self._exit_by:
                    os._exit(EXIT_HUNG)
                continue
            progress = self._beats + (recorder.activity if recorder is not None else 0)
            if progress != seen:
                seen, since = progress, now
            elif now - since > self.limit_s:
                self._fire(now - since)

    def _fire(self, idle_s: float) -> None:
        """No progress for too long: dump, then end the process (the main thread cannot be unwound)."""
        timeout = self.limit_s - WATCHDOG_GRACE_S
        key = "train_timeout_s" if self._steady and not self._relaxed else "init_timeout_s"
        self._exit_by = time.monotonic()
        self._report(
            "watchdog",
            f"no progress for {idle_s:.0f} s (no collective issued or finished, no new iteration; "
            f"parallel.{key}={timeout:g} + {WATCHDOG_GRACE_S:g} s): stopped by its watchdog",
        )
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(EXIT_HUNG)
