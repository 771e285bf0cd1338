"""Everything a checkpoint holds besides tensors, as one typed record: `TrainState`.

Written and read here only. The rank-common fields are meta.json (`state_dict()` / `load_state_dict()`,
the keys unchanged since format 2); this rank's RNG states are its own file rng/rank_XXXXX.pt. A checkpoint of
the per-rank format 1 (training/checkpoint/legacy.py) reads into the same record (`from_legacy`).

A new counter is a field of `TrainingProgress` (saved, loaded and defaulted for older checkpoints without
further code); a new section is a field here with its line in `state_dict` and `load_state_dict`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from training.checkpoint import files
from training.checkpoint.layout import CheckpointLayout


@dataclass
class TrainingProgress:
    """Counters saved with the model: where the run is. Stored as top-level keys of meta.json."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iters: int = 0

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> TrainingProgress:
        """The counters of a meta.json (or a legacy main file); a counter it lacks starts from its default."""
        return cls(**{f.name: int(saved[f.name]) for f in dataclasses.fields(cls) if f.name in saved})


@dataclass
class OptimizerScalars:
    """The optimizer's non-tensor state: Adam's step count and the loss scaler's state."""

    step: int
    loss_scaler: dict[str, Any]


@dataclass
class TrainState:
    """A checkpoint's non-tensor state.

    Attributes:
        progress: iteration, consumed samples, skipped iterations.
        config: the run config (Config.to_dict() form).
        layout: the layout that wrote it (CheckpointLayout; informational, loading works at any layout).
        lr_schedule: LRSchedule.state_dict(); None in a weights-only checkpoint.
        optimizer: the optimizer's scalars; None when the checkpoint holds no optimizer state (or, format 1,
            when they live in its per-rank files).
        has_optimizer: whether the checkpoint holds optimizer state.
        rng: this rank's RNG states (rng/rank_XXXXX.pt, not meta.json); None when not read or not saved.
        format_version: files.FORMAT_VERSION of the writer.
    """

    progress: TrainingProgress = field(default_factory=TrainingProgress)
    config: dict[str, Any] = field(default_factory=dict)
    layout: CheckpointLayout = field(default_factory=CheckpointLayout)
    lr_schedule: dict[str, Any] | None = None
    optimizer: OptimizerScalars | None = None
    has_optimizer: bool = False
    rng: dict[str, Any] | None = None
    format_version: int = files.FORMAT_VERSION

    @property
    def iteration(self) -> int:
        return self.progress.iteration

    def state_dict(self) -> dict[str, Any]:
        """meta.json: the rank-common fields (JSON-safe)."""
        return {
            "format_version": self.format_version,
            **dataclasses.asdict(self.progress),
            "config": self.config,
            "has_optimizer": self.has_optimizer,
            "optimizer": None if self.optimizer is None else dataclasses.asdict(self.optimizer),
            "lr_schedule": self.lr_schedule,
            "layout": self.layout.to_dict(),
        }

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        """Take the fields of a meta.json; keys that older writers left out keep their defaults."""
        optimizer = meta.get("optimizer")
        self.format_version = int(meta.get("format_version", files.FORMAT_VERSION))
        self.progress = TrainingProgress.from_dict(meta)
        self.config = meta["config"]
        self.has_optimizer = bool(meta.get("has_optimizer", True))
        self.optimizer = (
            None if optimizer is None else OptimizerScalars(int(optimizer["step"]), optimizer["loss_scaler"])
        )
        self.lr_schedule = meta.get("lr_schedule")
        self.layout = CheckpointLayout.from_dict(meta.get("layout") or {})

    @classmethod
    def from_legacy(cls, main: dict[str, Any]) -> TrainState:
        """The main file (model_optim_rng.pt) of a format-1 checkpoint: its optimizer state stays in its
        per-rank files, read by training/checkpoint/legacy.py."""
        return cls(
            progress=TrainingProgress.from_dict(main),
            config=main["config"],
            layout=CheckpointLayout.from_dict(main.get("layout") or {}),
            lr_schedule=main["lr_schedule"],
            has_optimizer=True,
            format_version=1,
        )


def read_train_state(iter_dir: str) -> TrainState:
    """The TrainState of the checkpoint in iter_dir (any format; its RNG states are read per rank by loader.load_rng)."""
    if files.is_legacy(iter_dir):
        from training.checkpoint.legacy import legacy_main_file

        return TrainState.from_legacy(legacy_main_file(iter_dir))
    state = TrainState()
    try:
        state.load_state_dict(files.read_meta(iter_dir))
    except (KeyError, TypeError, ValueError) as err:
        raise files.CheckpointError(
            f"checkpoint file {os.path.join(iter_dir, files.META)} is not a checkpoint's meta.json: "
            f"{type(err).__name__} {err}"
        ) from None
    return state


def read_saved_config(iter_dir: str) -> dict[str, Any]:
    """The run config (Config.to_dict() form) saved with the checkpoint in iter_dir."""
    return read_train_state(iter_dir).config


def rng_path(iter_dir: str, rank: int) -> str:
    """Where rank `rank` keeps its RNG states."""
    return os.path.join(iter_dir, "rng", f"rank_{rank:05d}.pt")
