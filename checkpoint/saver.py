"""Writing a checkpoint: every rank writes its pieces with torch.distributed.checkpoint into
iter_XXXXXXX.tmp.<pid>, checksums are gathered, then rank 0 renames the folder into place and writes the
trackers. `Checkpointer` runs that synchronously or, with async_save, in a background thread per rank on its
own gloo group: the thread first copies the pieces aside (overlapping the next forward and backward; the loop
waits for the copy only before its next optimizer step), then writes them. That group keeps the start-up timeout
(parallel.init_timeout_s, operations/watchdog.py), and its gathers go through the trainer's Collectives under the
name "checkpoint" (a hang report then shows how far each rank got in a save).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from checkpoint import dcp_modules, files
from checkpoint.files import CheckpointError
from checkpoint.state import staged_copy
from checkpoint.train_state import TrainState, rng_path
from checkpoint.write_errors import describe_write_error, reraise_interrupt
from parallel.comm import Collectives
from parallel.group_setup import creating_group
from parallel.lazy_torch import dcp

if TYPE_CHECKING:  # torch.distributed.checkpoint costs ~1.3 CPU s to import: write_checkpoint imports it
    from checkpoint.dcp_planners import GlobalPieces


@dataclass
class SaveJob:
    """Everything one save writes, captured at the moment of the save."""

    root: str
    iteration: int
    tensors: dict[str, GlobalPieces]
    train_state: TrainState | None  # rank 0 writes its meta.json, every rank its RNG states (when not None)
    keep_last: int  # checkpoint.keep_last: after this one, keep the newest N (0: all)
    before_tracker: Callable[[], None] = lambda: None  # test seam: a crash between files and tracker


class _Outcome(TypedDict, total=False):
    """What the background save left for the main thread: how long the copy took, and the result or error."""

    copy_seconds: float
    result: tuple[SaveJob, SaveResult]
    error: BaseException


@dataclass
class SaveResult:
    path: str
    size_bytes: int
    write_seconds: float


def _rank_info(group: ProcessGroup | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj: object, group: ProcessGroup | None, comm: Collectives) -> list:
    """Every rank's `obj` (the callers know what they sent: the list is as untyped as pickle's output)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    comm.all_gather_object(out, obj, group)
    return out


def _first_error(statuses: list) -> str | None:
    return next((status for status in statuses if isinstance(status, str)), None)


def _pieces_bytes(job: SaveJob) -> int:
    """Bytes of tensor data this rank writes (what a full disk is measured against)."""
    return sum(view.numel() * view.element_size() for t in job.tensors.values() for _, view in t.pieces)


def write_checkpoint(job: SaveJob, group: ProcessGroup | None = None, comm: Collectives | None = None) -> SaveResult:
    """Collective over all ranks (on `group`; its gathers through `comm`, the caller's door, or without one a
    door of its own that records nothing). Raises CheckpointError with one line if any rank failed; the
    previous checkpoint then stays the latest and the partial folder is removed."""
    comm = comm if comm is not None else Collectives()
    rank, world = _rank_info(group)
    started = time.perf_counter()
    final = os.path.join(job.root, files.iter_name(job.iteration))
    tmp = _all_gather(f"{final}.tmp.{os.getpid()}" if rank == 0 else None, group, comm)[0]
    status: str | None = None
    if os.path.exists(final):
        status = f"{final} already exists; a checkpoint is never overwritten"
    needed = _pieces_bytes(job)
    try:
        if status is None:
            os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
            if job.train_state is not None and job.train_state.rng is not None:
                torch.save(job.train_state.rng, rng_path(tmp, rank))
    except (OSError, RuntimeError) as err:  # torch.save reports a full disk as RuntimeError("unexpected pos")
        status = f"{tmp}: {describe_write_error(err, job.root, needed)}"
    error = _first_error(_all_gather(status, group, comm))
    written: dict[str, dict] = {}  # the data files' sizes and CRC-32s, taken while DCP wrote them
    if error is None:
        error = _write_tensors(job, tmp, group, rank, world, needed, written)
    sums: dict[str, dict] | str = {}
    if error is None:
        try:
            if rank == 0 and job.train_state is not None:
                files.write_json(job.train_state.state_dict(), os.path.join(tmp, files.META))
            sums = _checksums(tmp, _own_files(tmp, rank), written)
        except OSError as err:
            sums = f"{tmp}: {describe_write_error(err, job.root)}"
    gathered = _all_gather(sums if error is None else error, group, comm)
    error = error or _first_error(gathered)
    if rank == 0:
        error = error or _finalize(job, tmp, final, gathered)
    error = _all_gather(error, group, comm)[0]
    if error is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"checkpoint save at iteration {job.iteration} failed: {error}")
    return SaveResult(final, files.dir_size(final) if rank == 0 else 0, time.perf_counter() - started)


def _write_tensors(
    job: SaveJob, tmp: str, group: ProcessGroup | None, rank: int, world: int, needed: int, sums: dict[str, dict]
) -> str | None:
    """Every rank's pieces into `tmp` with torch.distributed.checkpoint (collective): None, or the error line;
    `sums` receives the size and CRC-32 of each data file this rank wrote. A second Ctrl-C re-raises (exit
    130), rank 0 removing the partial folder."""
    # DCP through its accessors, not at module level: a run that never saves does not pay its import
    # (Checkpointer.save imports it on the training thread before a background save).
    writer = dcp_modules.crc_writer().ChecksummingWriter(tmp)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp().save(
                job.tensors,
                storage_writer=writer,
                planner=dcp_modules.planners().PiecesSavePlanner(),
                process_group=group,
                no_dist=world == 1,
            )
    except BaseException as err:  # DCP raises CheckpointException (a BaseException) on every rank
        try:
            reraise_interrupt(err)  # a second Ctrl-C: exit as interrupted (130), leaving no partial folder
        except BaseException:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return f"writing the tensors failed: {describe_write_error(err, job.root, needed)}"
    sums.update(writer.sums)
    return None


def _checksums(tmp: str, names: list[str], written: dict[str, dict]) -> dict[str, dict]:
    """checksums.json's entries for `names`: a data file's from `written` (taken as DCP wrote and fsynced it:
    its bytes are not read back) when its size on disk matches, every other file read and fsynced here."""
    known = {
        name: written[name]
        for name in names
        if name in written and os.path.getsize(os.path.join(tmp, name)) == written[name]["size"]
    }
    sums = files.checksum_files(tmp, [name for name in names if name not in known])
    return {name: known[name] if name in known else sums[name] for name in names}


def _own_files(tmp: str, rank: int) -> list[str]:
    names = [name for name in os.listdir(tmp) if name.startswith(f"__{rank}_") and name.endswith(".distcp")]
    if os.path.exists(rng_path(tmp, rank)):
        names.append(os.path.relpath(rng_path(tmp, rank), tmp))
    if rank == 0:
        names += [name for name in (files.DCP_METADATA, files.META) if os.path.exists(os.path.join(tmp, name))]
    return names


def _finalize(job: SaveJob, tmp: str, final: str, gathered: list) -> str | None:
    """Rank 0, after every rank's files are written and fsynced: checksums, rename, trackers, pruning."""
    try:
        merged = {name: entry for sums in gathered for name, entry in sums.items()}
        files.write_json({"files": merged}, os.path.join(tmp, files.CHECKSUMS))
        files.fsync_dir(os.path.join(tmp, "rng"))
        files.fsync_dir(tmp)
        job.before_tracker()
        os.rename(tmp, final)
        files.fsync_dir(job.root)
        files.write_trackers(job.root, job.iteration)
        files.prune(job.root, job.keep_last, lambda msg: None)
    except OSError as err:
        return f"{tmp}: {describe_write_error(err, job.root)}"
    return None


class Checkpointer:
    """Saves of one run: synchronous, or asynchronous (one save in flight; the next save, or `wait()`,
    first finishes the previous one). Collective: every rank calls save() and wait() at the same points.

    `log(message)` receives the line printed after each save (size, write time, time the loop was blocked);
    `comm` (the trainer's Collectives) records the saves' gathers under "checkpoint"; `timeout_s` is that
    group's timeout (None: torch's default).
    """

    def __init__(
        self,
        async_save: bool,
        log: Callable[[str], None],
        comm: Collectives | None = None,
        timeout_s: float | None = None,
    ):
        self.async_save, self.log, self.comm = async_save, log, comm
        distributed = dist.is_available() and dist.is_initialized()
        # Own gloo group: object collectives on CPU also under NCCL, and the background thread's collectives
        # never interleave with the training loop's on the default group.
        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        self.group: ProcessGroup | None = None
        if distributed:
            with creating_group("the checkpoint process group (gloo)", dist.get_rank(), timeout_s):
                self.group = dist.new_group(backend="gloo", timeout=timeout)
        if comm is not None and self.group is not None:
            comm.register(self.group, "checkpoint", dist.get_world_size())
        self._thread: threading.Thread | None = None
        self._outcome: _Outcome = {}
        self._staging: dict | None = None  # async: CPU copies of the pieces, reused from save to save
        self._staged: threading.Event | None = None  # set once the save in flight has copied the pieces
        self._blocked = 0.0  # seconds the loop waited for the save in flight

    def save(self, job: SaveJob) -> None:
        """Write `job` (blocking), or (async) hand it to a background thread that first copies the pieces aside
        and then writes them; the loop only has to call `before_update()` before its next optimizer step."""
        # DCP's first import (write_checkpoint's) on this thread, never alongside training in the background one
        dcp()

        self.wait()
        started = time.perf_counter()
        if not self.async_save:
            result = write_checkpoint(job, self.group, self.comm)
            self._report(job, result, time.perf_counter() - started)
            return
        self._outcome, self._staged = {}, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(job, self._staged), name="checkpoint-save", daemon=True)
        self._thread.start()
        self._blocked = time.perf_counter() - started

    def before_update(self) -> None:
        """Called by the training loop before anything changes the weights or optimizer state (the optimizer
        step): waits until an async save has copied them. Forward and backward overlap with that copy."""
        if self._staged is None:
            return
        started = time.perf_counter()
        self._staged.wait()
        self._blocked += time.perf_counter() - started
        self._staged = None

    def _run(self, job: SaveJob, staged: threading.Event) -> None:
        labels = self.comm.region("checkpoint", job.iteration) if self.comm is not None else contextlib.nullcontext()
        with labels:  # this thread's own labels (parallel/comm.py)
            self._write_in_background(job, staged)

    def _write_in_background(self, job: SaveJob, staged: threading.Event) -> None:
        try:
            started = time.perf_counter()
            try:
                self._staging = job.tensors = staged_copy(job.tensors, self._staging)  # buffers reused
            finally:
                staged.set()
                self._outcome["copy_seconds"] = time.perf_counter() - started
            self._outcome["result"] = (job, write_checkpoint(job, self.group, self.comm))
        except BaseException as err:  # reported on the main thread by wait()
            self._outcome["error"] = err

    def poll(self) -> None:
        """Report a background save that has finished well. A failure is raised by the next save() or wait(),
        which every rank reaches at the same iteration (ranks may notice a finished thread at different ones)."""
        if self._thread is not None and not self._thread.is_alive() and "result" in self._outcome:
            self.wait()

    def wait(self) -> None:
        """Finish the save in flight (if any); re-raise its failure here, on the training thread."""
        if self._thread is None:
            return
        self.before_update()
        self._thread.join()
        self._thread = None
        if "error" in self._outcome:
            raise self._outcome["error"]
        job, result = self._outcome["result"]
        self._report(job, result, self._blocked)

    def _report(self, job: SaveJob, result: SaveResult, blocked: float) -> None:
        size = f"{result.size_bytes / 2**20:.1f} MiB" if result.size_bytes else "size on rank 0"
        mode = f"async, copied aside in {self._outcome['copy_seconds']:.2f} s" if self.async_save else "sync"
        self.log(
            f"saved checkpoint {result.path} ({size}, {mode}): written in {result.write_seconds:.2f} s, "
            f"training loop blocked {blocked:.3f} s"
        )
