"""The training loop's micro-batch stream, and the end of its data loader's worker processes on every way out.

The workers ignore SIGTERM and SIGINT (operations.preemption.ignore_stop_signals): scancel and Ctrl-C signal every
process of the job, and a worker killed by them would break the trainer's next batch before it has saved. The
price is that nothing but the trainer can stop them. torch stops them when the iterator is garbage-collected,
which an exception's traceback prevents (its frames hold the iterator), and does nothing once the interpreter is
exiting; multiprocessing's exit handler then sends them SIGTERM, which they ignore, and joins them forever: a
crashed rank that prints its traceback and never exits. So the loop closes its stream in a `finally`
(`MicrobatchStream.close`): torch's own shutdown first (the workers leave their queue loop), then SIGKILL for
any worker still alive after it. A worker also dies with its trainer (PR_SET_PDEATHSIG, set by
ignore_stop_signals) when the trainer is killed or leaves through os._exit.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator

from compat.torch_private import shutdown_loader_workers
from data.microbatch import Microbatch

KILL_WAIT_S = 5.0  # for a SIGKILLed worker to be reaped: the kernel ends it at once, the wait is a bound only


class MicrobatchStream(Iterator[Microbatch]):
    """The micro-batches of the iterator `start()` returns, and `close()` for its worker processes."""

    def __init__(self, start: Callable[[], Iterator[Microbatch]]):
        before = {child.pid for child in multiprocessing.active_children()}
        self._iterator = start()
        # The processes the iterator started (a DataLoader starts all its workers as its iterator is made):
        # multiprocessing's public handles on them, for the SIGKILL that follows torch's shutdown if need be.
        self._workers = [child for child in multiprocessing.active_children() if child.pid not in before]

    def __iter__(self) -> MicrobatchStream:
        return self

    def __next__(self) -> Microbatch:
        return next(self._iterator)

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the loader's workers (empty with data.num_workers=0)."""
        return [worker.pid for worker in self._workers if worker.pid is not None]

    def close(self) -> None:
        """Stop the workers (idempotent): torch's shutdown, then SIGKILL for any still alive (one busy in a read
        past torch's wait, which ends with a SIGTERM the worker ignores)."""
        shutdown_loader_workers(self._iterator)
        for worker in self._workers:
            if worker.is_alive():
                worker.kill()
                worker.join(KILL_WAIT_S)
