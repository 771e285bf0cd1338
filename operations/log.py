"""The project's one rank-aware console logger, in operations/ so that the operations modules (threads, watchdog)
and training/ share it without operations/ importing training/."""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "ptdp"


class _StdoutHandler(logging.StreamHandler):
    """A handler on whatever sys.stdout is when a record is written (tests and tools swap sys.stdout; a
    handler bound to the first one would write into a closed stream)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def get_logger(rank: int = 0) -> logging.Logger:
    """The project's logger: INFO to stdout on the logging rank (rank 0), warnings and errors on every rank."""
    logger = logging.getLogger(LOGGER_NAME)
    if not logger.handlers:
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s" if rank == 0 else f"[rank {rank}] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return logger
