"""One line for a failed write, whatever layer it failed in: a full disk is always called "no space left on
device", with the folder and its free space.

A full disk rarely reaches the caller as OSError(ENOSPC): torch's zip writer reports it as "unexpected pos
704 vs 598", torch.distributed.checkpoint wraps every rank's error in a CheckpointException (a
BaseException holding (exception, traceback) pairs), and a short write may raise nothing at all. So the
errors are walked (cause, context, DCP failures) for ENOSPC / EDQUOT, and otherwise the folder's free space
is asked: a failed write with less free than it needed is a full disk too. The same walk finds a second
Ctrl-C that DCP wrapped (`reraise_interrupt`).
"""

from __future__ import annotations

import errno
from collections.abc import Iterator

from data.index_budget import free_disk_bytes

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def error_chain(err: BaseException) -> Iterator[BaseException]:
    """`err` and every exception behind it: __cause__, __context__ and a CheckpointException's failures."""
    stack: list[object] = [err]
    seen: list[BaseException] = []
    while stack:
        item = stack.pop()
        if isinstance(item, tuple) and item and isinstance(item[0], BaseException):
            item = item[0]  # DCP's (exception, traceback) pair
        if not isinstance(item, BaseException) or any(item is s for s in seen):
            continue
        seen.append(item)
        yield item
        stack += [item.__cause__, item.__context__]
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            stack += list(failures.values())


def reraise_interrupt(err: BaseException) -> None:
    """Raise the KeyboardInterrupt / SystemExit inside `err`, if any: a second Ctrl-C during a DCP save or
    load comes back wrapped in its CheckpointException (on every rank), and must still exit as interrupted
    (130), not as a failed save or an unreadable checkpoint."""
    interrupt = next((e for e in error_chain(err) if isinstance(e, (KeyboardInterrupt, SystemExit))), None)
    if interrupt is not None:
        raise interrupt from None


def is_disk_full(err: BaseException, folder: str, needed_bytes: int = 0) -> bool:
    """Whether `err`, raised writing under `folder`, comes from a full disk (or quota)."""
    errnos = {e.errno for e in error_chain(err) if isinstance(e, OSError) and e.errno is not None}
    if errnos & set(DISK_FULL_ERRNOS):
        return True
    if errnos:  # the OS named another cause (permissions, a missing folder): not a full disk
        return False
    free = free_disk_bytes(folder)
    return free is not None and free < max(needed_bytes, 1 << 20)


def one_line(err: BaseException) -> str:
    """The type and last line of an error (DCP's messages are whole tracebacks)."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[-1] if text else ''}".strip()


def describe_write_error(err: BaseException, folder: str, needed_bytes: int = 0) -> str:
    """One line for a failed write under `folder`: "no space left on device ..." (with the free space and
    what to do) when the disk is full, else the error's type and last line."""
    if not is_disk_full(err, folder, needed_bytes):
        return one_line(err)
    free = free_disk_bytes(folder)
    have = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
    need = f", about {needed_bytes / 2**20:.1f} MiB needed" if needed_bytes else ""
    return (
        f"no space left on device under {folder} ({have}{need}): free space there or point run.dir at a "
        f"bigger disk ({one_line(err)})"
    )
