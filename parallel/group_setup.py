"""Creating a process group within parallel.init_timeout_s: a timeout becomes one line naming the key.

Creating a group is a rendezvous: every member writes its address to the store and waits for the others' (the
TCPStore's `wait timeout after ...ms`, a DistStoreError), then gloo connects every pair (`Gloo connectFullMesh
failed ... timed out connecting`, a RuntimeError; it also comes when the peer it connects to has already given
up and left). Torch raises these with a C++ traceback's worth of context and no word of the setting that bounds
them. `creating_group` turns exactly those timeouts into `GroupCreationTimeout`, a `CollectiveError`, so the
trainer reports it as every other start-up collective that timed out (one line, exit 5); any other error passes
through unchanged.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator

from parallel.comm import CollectiveError

# The timeout texts of torch's store ("wait timeout after 10ms", "Socket Timeout", "has timed out after") and
# gloo ("timed out connecting", "Timed out waiting"): a RuntimeError without one is not a timeout.
_TIMEOUT_TEXT = re.compile(r"\btime(d)?[ _-]?out\b", re.IGNORECASE)


class GroupCreationTimeout(CollectiveError):
    """Creating a process group timed out: not every member joined within the timeout (the message names
    parallel.init_timeout_s and its value, the group, and torch's first line)."""


def is_timeout(error: BaseException) -> bool:
    """Whether `error`, raised while creating a group, is the store's or gloo's timeout."""
    return isinstance(error, RuntimeError) and _TIMEOUT_TEXT.search(str(error)) is not None


@contextlib.contextmanager
def creating_group(what: str, rank: int, timeout_s: float | None) -> Iterator[None]:
    """Run the creation of the group `what` (e.g. "the world group (2 ranks, gloo)") on global rank `rank`;
    its timeout is parallel.init_timeout_s=`timeout_s` (None: torch's default). A store or gloo timeout raises
    GroupCreationTimeout; other errors propagate as they are."""
    started = time.perf_counter()
    try:
        yield
    except RuntimeError as error:
        if not is_timeout(error):
            raise
        seconds = time.perf_counter() - started
        bound = "torch's default timeout" if timeout_s is None else f"parallel.init_timeout_s={timeout_s:g}"
        remedy = "" if timeout_s is None else "raise parallel.init_timeout_s if ranks start that far apart, else "
        torch_line = str(error).strip().splitlines()[0]
        raise GroupCreationTimeout(
            f"rank {rank}: creating {what} timed out after {seconds:.2f} s ({bound}): not every rank joined within "
            f"it; {remedy}look for a rank that did not start or failed before joining (torch: {torch_line})"
        ) from error
