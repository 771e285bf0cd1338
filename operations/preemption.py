"""Preemption: SIGTERM, SIGUSR1 and SIGINT ask the run to stop at the next iteration boundary, and the clock
that train.exit_duration_mins counts on.

SLURM sends SIGTERM on `scancel`, on preemption and at the time limit; `#SBATCH --signal=USR1@<seconds>` is how
a job asks for a warning before it; Ctrl-C sends SIGINT. The handler only records the signal. At the next
iteration boundary every rank shares what it got (`operations.guards.agree`, one all-reduce), so all ranks stop
after the same iteration, save a checkpoint of it and exit with `EXIT_PREEMPTED`. A SIGINT that arrives while
a stop is already pending stops at once (`Interrupted`, no checkpoint), as a second Ctrl-C is expected to.

Under torchrun a rank also stops, the same way, when its launcher dies: `kill -USR1 <torchrun>` kills torchrun
(it has no handler for USR1), and so do kill -9 and the OOM killer; the ranks would otherwise train on with
nobody to collect them. The kernel sends each rank LAUNCHER_DIED when torchrun goes (PR_SET_PDEATHSIG; a
signal of its own, because a dying torchrun can look alive to getppid() for a moment: its threads exit one by
one), and the iteration boundary checks the parent pid as well (for a launcher that died before the rank asked
for that). A rank that finds its launcher gone stops as if torchrun had sent SIGTERM.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import FrameType

from operations.run_lock import process_start_ticks

# what signal.signal returns: the previous handler, SIG_DFL / SIG_IGN, or None (not installed from Python)
SignalHandler = Callable[[int, FrameType | None], object] | int | None
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
LAUNCHER_DIED = signal.SIGRTMIN + 1  # a real-time signal nobody else sends (torchrun forwards none of them)


class Interrupted(KeyboardInterrupt):
    """A second SIGINT: stop now, without a checkpoint."""


class PreemptionHandler:
    """Records the first of SIGTERM / SIGUSR1 / SIGINT; use as a context manager around the run."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._received: signal.Signals | None = None
        self._previous: dict[int, SignalHandler] = {}
        self._pid = os.getpid()
        self._launcher = launcher_pid(os.environ if environ is None else environ)

    @property
    def received(self) -> signal.Signals | None:
        """The stop signal this rank got, if any; a launcher found dead counts as SIGTERM (read at every
        iteration boundary, so this is where a missed parent-death signal is caught)."""
        if self._received is None and self._launcher is not None and os.getppid() != self._launcher:
            self._note(signal.SIGTERM, launcher_gone=True)
        return self._received

    def __enter__(self) -> PreemptionHandler:
        # Python allows handlers only in the main thread (tests that drive main() from a thread get none).
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            if self._launcher is not None:
                self._previous[LAUNCHER_DIED] = signal.signal(LAUNCHER_DIED, self._handle_launcher_death)
                ask_for_signal_on_parent_death(LAUNCHER_DIED)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a forked child that inherited this handler: the trainer decides
            return
        sig = signal.Signals(signum)
        if sig == signal.SIGINT and self.received is not None:
            raise Interrupted(f"second interrupt ({sig.name} after {self.received.name}): stopped at once")
        if self._received is None:
            self._note(sig)

    def _handle_launcher_death(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() == self._pid and self._received is None:
            self._note(signal.SIGTERM, launcher_gone=True)

    def _note(self, sig: signal.Signals, launcher_gone: bool = False) -> None:
        """Record the stop and say why, once."""
        self._received = sig
        if launcher_gone:
            why = f"torchrun (pid {self._launcher}), which started this rank, is gone"
        else:
            why = f"received {sig.name}"
        # os.write, not logging: a handler may run while the logging stream's lock is held.
        os.write(
            2, f"{why}: stopping after this iteration with a checkpoint (press Ctrl-C again to stop at once)\n".encode()
        )


def launcher_pid(environ: Mapping[str, str]) -> int | None:
    """The pid of the torchrun agent that started this rank (its parent), or None when not under torchrun.
    Only torchrun's ranks watch their parent: a plain run's parent is a shell, and `nohup ... &` followed by
    a logout must not stop it."""
    return os.getppid() if "TORCHELASTIC_RUN_ID" in environ else None


def ask_for_signal_on_parent_death(sig: int) -> bool:
    """Ask Linux to send `sig` to this process when its parent dies (prctl PR_SET_PDEATHSIG); False where that
    is not available (the iteration boundary's parent check still catches it)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader worker_init_fn: SLURM's scancel and a terminal's Ctrl-C signal every process, and torch's
    workers die of SIGTERM / SIGINT, which would break the trainer's next batch before it can save. Workers
    ignore them; the trainer stops them when it is done, on every way out (operations/loader_workers.py), and the
    kernel kills them when the trainer dies first (SIGKILL on parent death: a killed trainer, or one that
    leaves through os._exit, cannot stop them; torch's own check of the parent runs only between batches)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    ask_for_signal_on_parent_death(signal.SIGKILL)


def job_start_time(environ: Mapping[str, str] | None = None) -> float:
    """When this job started, in seconds since the epoch: SLURM_JOB_START_TIME under SLURM, else the start of
    this process (from /proc), else now. exit_duration_mins counts from here, so building the data and the
    model and loading a checkpoint count against the time limit too."""
    environ = os.environ if environ is None else environ
    slurm_start = environ.get("SLURM_JOB_START_TIME", "")
    if slurm_start.isdigit():
        return float(slurm_start)
    start_ticks = process_start_ticks(os.getpid())
    if start_ticks is None:
        return time.time()
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class SetupInterrupted(Interrupted):
    """A stop signal during setup (the sample corpus, the data indices): nothing to save yet, stopped at once."""


@contextmanager
def stop_at_once(what: str) -> Iterator[None]:
    """Inside, SIGTERM / SIGUSR1 / SIGINT raise SetupInterrupted at once instead of waiting for an iteration
    boundary that setup work (minutes of index building) does not have; the handlers in place before come back
    after. The exception unwinds through the builders' cleanup, so no temporary file is left. A signal the
    PreemptionHandler recorded before the block stops it at its start."""
    if threading.current_thread() is not threading.main_thread():  # handlers exist in the main thread only
        yield
        return
    pid = os.getpid()

    def handle(signum: int, frame: FrameType | None) -> None:
        if os.getpid() == pid:  # a forked worker leaves the decision to the trainer
            raise SetupInterrupted(
                f"received {signal.Signals(signum).name} while {what}: stopped before the first iteration "
                f"(nothing to save yet); temporary files removed"
            )

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    try:
        owner = getattr(previous[signal.SIGTERM], "__self__", None)
        if isinstance(owner, PreemptionHandler) and owner.received is not None:
            handle(owner.received, None)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
