"""Checkpoints under run.dir/checkpoints, in Megatron's directory layout, crash-safe.

    checkpoints/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   model chunks, plain optimizer,
                                                                          LR schedule, counters, config (dp rank 0)
    checkpoints/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/dp_rank_{dp:03d}.pt   this rank's RNG states and, with the
                                                                          distributed optimizer, its shard
    checkpoints/latest_checkpointed_iteration.txt                          the tracker (Megatron's name)
    checkpoints/latest                                                     the same number, a short alias

Every file is written aside then renamed, and the trackers are written last, after every rank has finished:
a crash mid-save leaves the previous checkpoint as the one that loads. Loading uses weights_only=True.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from parallel.state import ParallelState

TRACKER = "latest_checkpointed_iteration.txt"
ALIAS = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file."""


@dataclass
class TrainingProgress:
    """Counters saved with the model: where the run is."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iters: int = 0


def rank_dir(root: str, iteration: int, state: ParallelState) -> str:
    return os.path.join(root, f"iter_{iteration:07d}", f"mp_rank_{state.tp_rank:02d}_{state.pp_rank:03d}")


def atomic_save(obj: Any, path: str) -> None:
    """torch.save to path.tmp, fsync, then rename over path."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def atomic_write_text(text: str, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_tracker(root: str) -> Optional[int]:
    """The iteration of the latest complete checkpoint under root, or None."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path, encoding="utf-8").read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"checkpoint tracker {path} holds {text!r}, not an iteration number") from None


def _barrier(state: ParallelState) -> None:
    if state.is_distributed:
        dist.barrier()


def save_checkpoint(root: str, state: ParallelState, progress: TrainingProgress, chunks: list,
                    optimizer: Any, lr_schedule: Any, rng_state: dict, config: dict,
                    distributed_optimizer: bool, before_tracker: Callable[[], None] = lambda: None) -> str:
    """Every rank writes its files, all ranks meet, then rank 0 writes the trackers. Returns the iter dir."""
    directory = rank_dir(root, progress.iteration, state)
    os.makedirs(directory, exist_ok=True)
    if state.dp_rank == 0:
        payload = {"iteration": progress.iteration, "consumed_samples": progress.consumed_samples,
                   "skipped_iters": progress.skipped_iters, "config": config,
                   "model": [chunk.state_dict() for chunk in chunks],
                   "lr_schedule": lr_schedule.state_dict(),
                   "optimizer": None if distributed_optimizer else optimizer.state_dict(),
                   "layout": {"tp": state.tp_size, "pp": state.pp_size, "vp": state.vp_size}}
        atomic_save(payload, os.path.join(directory, "model_optim_rng.pt"))
    per_rank = {"rng": rng_state, "optimizer": optimizer.state_dict() if distributed_optimizer else None}
    atomic_save(per_rank, os.path.join(directory, f"dp_rank_{state.dp_rank:03d}.pt"))
    _barrier(state)
    before_tracker()  # tests use this seam to simulate a crash between the files and the tracker
    if state.rank == 0:
        atomic_write_text(f"{progress.iteration}\n", os.path.join(root, TRACKER))
        atomic_write_text(f"{progress.iteration}\n", os.path.join(root, ALIAS))
    _barrier(state)
    return os.path.dirname(directory)


def _load_file(path: str) -> dict:
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing (was the run saved with another layout?)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # unpickling errors have many types; name the file either way
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CheckpointError(f"checkpoint file {path} cannot be read: {reason}") from None


def load_checkpoint(root: str, state: ParallelState, chunks: list, optimizer: Any, lr_schedule: Any,
                    distributed_optimizer: bool) -> Optional[tuple[TrainingProgress, dict]]:
    """Load the latest checkpoint into chunks / optimizer / schedule; returns (progress, rng_state) or None."""
    iteration = read_tracker(root)
    if iteration is None:
        return None
    directory = rank_dir(root, iteration, state)
    main = _load_file(os.path.join(directory, "model_optim_rng.pt"))
    per_rank = _load_file(os.path.join(directory, f"dp_rank_{state.dp_rank:03d}.pt"))
    layout = main.get("layout", {})
    expected = {"tp": state.tp_size, "pp": state.pp_size, "vp": state.vp_size}
    if layout != expected:
        raise CheckpointError(f"checkpoint {directory} was saved with layout {layout}, this run is {expected}")
    for chunk, chunk_state in zip(chunks, main["model"]):
        chunk.load_state_dict(chunk_state)
    optimizer.load_state_dict(per_rank["optimizer"] if distributed_optimizer else main["optimizer"])
    lr_schedule.load_state_dict(main["lr_schedule"])
    progress = TrainingProgress(main["iteration"], main["consumed_samples"], main.get("skipped_iters", 0))
    return progress, per_rank["rng"]
