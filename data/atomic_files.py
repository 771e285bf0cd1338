"""Files written whole or not at all, readable by whoever the user's umask says.

Every output the trainer, preprocess and the converters write goes to `<path>.tmp-<host>-<pid>` and is
renamed into place when complete, so readers never see a partial file. `tempfile.mkstemp` and `mkdtemp`
(and libraries built on them, such as safetensors' `save_file`) create 0600 files / 0700 folders whatever
the umask, so a teammate could not read a shared index cache or an exported model: `publish` sets the mode
the umask gives a plain `open()` before the rename. A temporary file left by a killed process (kill -9,
a node that died) carries its host and pid, so the next start on that host removes it
(`remove_stale_temporaries`) without touching one a live process is still writing.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager

_TMP_PATTERN = re.compile(r"\.tmp-(?P<host>[^/]+)-(?P<pid>\d+)$")


def process_umask() -> int:
    """This process's umask, read from /proc where possible: os.umask() sets it while reading it, and a
    thread creating a file in between would get a world-writable one."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: str, directory: bool = False) -> None:
    """Give `path` the mode a plain open() / mkdir() would have given it (0666 / 0777 less the umask)."""
    base = 0o777 if directory else 0o666
    os.chmod(path, base & ~process_umask())


def temporary_path(path: str) -> str:
    """The name `path` is written under until complete: `<path>.tmp-<host>-<pid>`."""
    return f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"


def publish(tmp: str, path: str, directory: bool = False) -> None:
    """Set the umask's mode on the finished `tmp` and rename it onto `path`."""
    honour_umask(tmp, directory)
    os.replace(tmp, path)


@contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """Yield the temporary path to write `path` under; published when the block ends normally, removed on
    any exception (a signal's KeyboardInterrupt included)."""
    tmp = temporary_path(path)
    try:
        yield tmp
        publish(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (another user's live process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temporaries(folder: str, prefix: str = "") -> list[str]:
    """Remove the temporary files and folders in `folder` (those whose name starts with `prefix`) left by dead
    processes of this host; returns their paths. A missing or unreadable folder holds none."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    host, removed = socket.gethostname(), []
    for name in names:
        match = _TMP_PATTERN.search(name)
        if name.startswith(prefix) and match and match.group("host") == host and not pid_alive(int(match.group("pid"))):
            path = os.path.join(folder, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            except OSError:  # gone already (another rank cleaned it) or not ours to remove
                continue
            removed.append(path)
    return removed
