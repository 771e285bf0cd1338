"""Converter outputs written whole or not at all.

Every converter writes into `OUT.tmp-<host>-<pid>` beside its output (data/atomic_files.py's naming) and renames
it into place when complete. Ctrl-C (KeyboardInterrupt) and SIGTERM (`Stopped`, raised by a handler installed
for the duration) unwind through the cleanup, so neither leaves the staging folder behind; one left by a
process that died harder (kill -9, a lost node) is removed by the next run writing the same output, once its
process is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from data.atomic_files import atomic_output, remove_stale_temporaries, temporary_path


class Stopped(BaseException):
    """A stop signal (SIGTERM) while a converter writes; unwinds like KeyboardInterrupt (not an Exception, so
    no `except Exception` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def stop_raises() -> Iterator[None]:
    """Inside, SIGTERM raises Stopped, as Ctrl-C raises KeyboardInterrupt, so cleanup code runs; the handler
    found on entry comes back after. Signal handlers live in the main thread only: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    raised: list[int] = []

    def handle(signum: int, frame: FrameType | None) -> None:
        if not raised:  # once: a second SIGTERM must not cut the cleanup the first one started
            raised.append(signum)
            raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:  # None: a handler installed outside Python; the default is the closest we can restore
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def check_output_free(out_dir: str) -> None:
    """Refuse to write over an existing non-empty folder or a file (one line, the path)."""
    if os.path.exists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)):
        raise ValueError(f"output {out_dir} already exists and is not an empty folder")


def remove_stale_staging(out_path: str) -> None:
    """Remove the staging files and folders of out_path (`OUT.tmp-<host>-<pid>`) left by dead processes of this
    host, each named on stderr; a live process's are kept."""
    folder, name = os.path.split(os.path.normpath(out_path))
    for stale in remove_stale_temporaries(folder or ".", prefix=f"{name}.tmp-"):
        print(f"removed {stale}, left by an interrupted conversion (its process is gone)", file=sys.stderr)


@contextlib.contextmanager
def staged_folder(out_dir: str) -> Iterator[str]:
    """A folder beside out_dir to write the output into: renamed onto out_dir when the block completes,
    removed when it fails or is stopped (Ctrl-C, SIGTERM), so out_dir is never half-written (out_dir must be
    absent or an empty folder)."""
    check_output_free(out_dir)
    with stop_raises():
        remove_stale_staging(out_dir)
        tmp = temporary_path(os.path.normpath(out_dir))
        try:
            os.makedirs(tmp)
        except OSError as err:
            raise ValueError(f"output {out_dir}: cannot create {tmp} beside it ({err.strerror})") from None
        try:
            yield tmp
            publish_folder(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


@contextlib.contextmanager
def staged_file(out_file: str) -> Iterator[str]:
    """The temporary path to write out_file under: renamed onto it when the block completes, removed when it
    fails or is stopped (Ctrl-C, SIGTERM)."""
    folder = os.path.dirname(os.path.abspath(out_file))
    if not os.path.isdir(folder):
        raise ValueError(f"output {out_file}: its folder {folder} does not exist; create it first")
    with stop_raises():
        remove_stale_staging(out_file)
        with atomic_output(os.path.normpath(out_file)) as tmp:
            yield tmp


def publish_folder(tmp: str, out_dir: str) -> None:
    """Rename the finished folder into place (OUT_DIR absent or an empty folder)."""
    if os.path.isdir(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
    os.replace(tmp, out_dir)
