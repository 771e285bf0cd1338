"""One run per folder: a lock file in run.dir, held by rank 0 for the life of the run.

The file (`run.dir/run.lock`) is created with O_EXCL and holds the owner's host, pid, process start time and
SLURM job id. A second trainer finds it and is refused with a message naming that pid and host, unless the
holder is provably gone: on the same host, no process with that pid and start time exists (a kill -9, a
crash); on another host, it belongs to this same SLURM job id (a requeued job that landed on other nodes:
SLURM never runs two copies of one job at once). A lock from another host that cannot be checked is never
broken silently: the message says which file to delete once that process is known to be gone.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only for the annotation: the lock itself is plain Python
    import torch

    from parallel.comm import Collectives

LOCK_NAME = "run.lock"


class RunLockError(RuntimeError):
    """run.dir is in use by another live trainer; the message names its pid and host."""


def process_start_ticks(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot, or None if there is no such process (or no
    /proc). The one reader of /proc/<pid>/stat: the lock's owner record and the job clock (preemption.py)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            # Field 22 (after the parenthesised command name, which may hold spaces) is the start time.
            return int(handle.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _owner_record() -> dict:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "start_ticks": process_start_ticks(pid),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def holder_is_gone(holder: dict) -> bool:
    """Whether the process that wrote `holder` has certainly exited (see the module docstring)."""
    if holder.get("host") != socket.gethostname():
        job = os.environ.get("SLURM_JOB_ID")
        return bool(job) and holder.get("slurm_job_id") == job
    ticks = process_start_ticks(int(holder.get("pid", -1)))
    return ticks is None or (holder.get("start_ticks") is not None and ticks != holder["start_ticks"])


class RunLock:
    """`acquire()` takes run_dir/run.lock or raises RunLockError; `release()` removes it if still ours."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.held = False
        self.broke_stale: dict | None = None  # the dead holder whose lock was replaced, for the log

    def _read_holder(self) -> dict | None:
        try:
            with open(self.path, encoding="utf-8") as handle:
                holder = json.load(handle)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # half-written by a process killed while creating it: unreadable, so gone
        # Only a record this module writes names a process that can hold the lock; anything else in the file
        # (a list, a pid that is not a number: an edited or foreign file) is treated as the half-written case.
        if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int) or isinstance(holder["pid"], bool):
            return {}
        return holder

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(_owner_record(), handle)
        return True

    def acquire(self) -> None:
        for _ in range(3):  # a stale lock removed by two starters at once: one of them wins the O_EXCL
            if self._try_create():
                self.held = True
                return
            holder = self._read_holder()
            if holder is None:
                continue  # released between our two calls
            if holder and not holder_is_gone(holder):
                raise RunLockError(
                    f"run.dir {os.path.dirname(self.path)} is in use by another trainer: pid {holder.get('pid')} "
                    f"on host {holder.get('host')} (since {holder.get('since')}); use another run.dir, or "
                    f"delete {self.path} if that process is gone"
                )
            self.broke_stale = holder
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        raise RunLockError(f"cannot take the run lock {self.path}: other trainers keep starting in this run.dir")

    def stale_warning(self) -> str | None:
        """The warning line for a replaced lock (None when none was): whose it was, or that it was unreadable."""
        if self.broke_stale is None:
            return None
        if not self.broke_stale:
            return f"warning: replaced the unreadable lock file {self.path} (half-written or not a lock record)"
        holder = self.broke_stale
        return (
            f"warning: removed the stale lock of pid {holder.get('pid')} on host {holder.get('host')} from {self.path}"
        )

    def release(self) -> None:
        """Remove the lock if it is still this process's (never another trainer's)."""
        if not self.held:
            return
        self.held = False
        holder = self._read_holder()
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            os.remove(self.path)


def _is_link_loop(path: str) -> bool:
    try:
        os.stat(path)
    except OSError as err:
        return err.errno == errno.ELOOP
    return False


def _unusable_run_dir_message(run_dir: str, err: OSError, lock_path: str) -> str:
    """One line for a run.dir that cannot be created or written; a broken symbolic link or a file where the
    folder belongs (both of which makedirs reports as "File exists") is named as one."""
    path = err.filename if isinstance(err.filename, str) else lock_path
    if os.path.islink(path) and not os.path.exists(path):
        broken = (
            "loops back on itself" if _is_link_loop(path) else f"points to {os.readlink(path)}, which does not exist"
        )
        return (
            f"run.dir={run_dir} cannot hold the run: {path} is a symbolic link that {broken}: create the folder it "
            f"should point to, or give run.dir a real folder"
        )
    if err.errno == errno.EEXIST and os.path.exists(path) and not os.path.isdir(path):
        return f"run.dir={run_dir} cannot hold the run: {path} is a file, not a folder: give run.dir a folder"
    return (
        f"run.dir={run_dir} cannot hold the run: {err.strerror} ({path}): give run.dir a folder this user can "
        f"create and write"
    )


def take_run_lock(lock: RunLock, rank: int, world_size: int, device: torch.device, comm: Collectives) -> str | None:
    """Rank 0 creates run.dir and takes its lock; every rank learns the outcome (one all-reduce over the world,
    through `comm`, the world's door DistEnv.comm: recorded, and a timeout is a CollectiveError). Returns the
    error ("" on ranks other than 0, which print nothing), or None."""
    error = None
    if rank == 0:
        try:
            os.makedirs(os.path.dirname(lock.path), exist_ok=True)
            lock.acquire()
        except RunLockError as err:
            error = str(err)
        except OSError as err:  # run.dir a file, not writable, on a full or read-only disk: name the key
            error = _unusable_run_dir_message(os.path.dirname(lock.path), err, lock.path)
    if world_size > 1:
        import torch.distributed  # here only: the lock itself is plain Python (tools and tests use it without torch)

        failed = torch.tensor([int(error is not None)], device=device)
        comm.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
        if failed.item() and error is None:
            error = ""
    return error
