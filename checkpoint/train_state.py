"""Everything a checkpoint holds besides tensors, as one typed record: `TrainState`.

Written and read here only. The rank-common fields are meta.json (`state_dict()` / `load_state_dict()`,
the keys unchanged since format 2); this rank's RNG states are its own file rng/rank_XXXXX.pt. A checkpoint of
the per-rank format 1 (checkpoint/legacy.py) reads into the same record (`from_legacy`).

A new counter is a field of `TrainingProgress` and its key in `MetaJson` (loaded and defaulted for older
checkpoints without further code); a new section is a field here with its key in `MetaJson` and its line in
`state_dict` and `load_state_dict`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypedDict

from checkpoint import files
from checkpoint.layout import CheckpointLayout
from checkpoint.legacy import MAIN_FILE, legacy_main_file, rank_dir

ConfigSections = dict[str, dict[str, object]]  # Config.to_dict(): section -> key -> value


class ScalarsJson(TypedDict):
    """meta.json's "optimizer": `OptimizerScalars`."""

    step: int
    loss_scaler: dict[str, float]


class MetaJson(TypedDict):
    """meta.json as `TrainState.state_dict()` writes it (format 2 on), keys in file order. Readers take any
    JSON object (`load_state_dict`): older writers left some keys out."""

    format_version: int
    iteration: int
    consumed_samples: int
    skipped_iters: int
    config: ConfigSections
    has_optimizer: bool
    optimizer: ScalarsJson | None
    lr_schedule: Mapping[str, object] | None
    layout: dict[str, int | str | bool]


def _whole(value: object, key: str) -> int:
    """int(value) of a saved counter; TypeError naming `key` for a value that is no number."""
    if not isinstance(value, (int, float, str)):
        raise TypeError(f"{key}={value!r} is not a whole number")
    return int(value)


def _mapping(value: object, key: str) -> dict:
    """A saved section that must be a mapping; TypeError naming `key` otherwise."""
    if not isinstance(value, dict):
        raise TypeError(f"{key} is {type(value).__name__}, not a mapping")
    return value


def _config_sections(value: object) -> ConfigSections:
    """The saved run config: a mapping of sections, each a mapping; TypeError otherwise."""
    sections = _mapping(value, "config")
    for name, section in sections.items():
        _mapping(section, f"config.{name}")
    return sections


@dataclass
class TrainingProgress:
    """Counters saved with the model: where the run is. Stored as top-level keys of meta.json."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iters: int = 0

    @classmethod
    def from_dict(cls, saved: Mapping[str, object]) -> TrainingProgress:
        """The counters of a meta.json (or a legacy main file); a counter it lacks starts from its default."""
        return cls(**{f.name: _whole(saved[f.name], f.name) for f in dataclasses.fields(cls) if f.name in saved})


@dataclass
class OptimizerScalars:
    """The optimizer's non-tensor state: Adam's step count and the loss scaler's state."""

    step: int
    loss_scaler: dict[str, float]

    @classmethod
    def from_dict(cls, saved: object) -> OptimizerScalars:
        """meta.json's "optimizer"; TypeError for a value of the wrong kind."""
        scalars = _mapping(saved, "optimizer")
        loss_scaler = _mapping(scalars["loss_scaler"], "optimizer.loss_scaler")
        for key, value in loss_scaler.items():
            if not isinstance(value, (int, float)):
                raise TypeError(f"optimizer.loss_scaler.{key}={value!r} is not a number")
        return cls(_whole(scalars["step"], "optimizer.step"), loss_scaler)


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
    config: ConfigSections = field(default_factory=dict)
    layout: CheckpointLayout = field(default_factory=CheckpointLayout)
    lr_schedule: Mapping[str, object] | None = None
    optimizer: OptimizerScalars | None = None
    has_optimizer: bool = False
    rng: dict[str, object] | None = None  # RNGStatesTracker.state_dict(), passed through
    format_version: int = files.FORMAT_VERSION

    @property
    def iteration(self) -> int:
        return self.progress.iteration

    def state_dict(self) -> MetaJson:
        """meta.json: the rank-common fields (JSON-safe)."""
        optimizer = self.optimizer
        return {
            "format_version": self.format_version,
            "iteration": self.progress.iteration,
            "consumed_samples": self.progress.consumed_samples,
            "skipped_iters": self.progress.skipped_iters,
            "config": self.config,
            "has_optimizer": self.has_optimizer,
            "optimizer": None if optimizer is None else {"step": optimizer.step, "loss_scaler": optimizer.loss_scaler},
            "lr_schedule": self.lr_schedule,
            "layout": self.layout.to_dict(),
        }

    def load_state_dict(self, meta: Mapping[str, object]) -> None:
        """Take the fields of a meta.json (any JSON object: KeyError / TypeError / ValueError for one that is
        not a checkpoint's); keys that older writers left out keep their defaults."""
        optimizer, lr_schedule = meta.get("optimizer"), meta.get("lr_schedule")
        self.format_version = _whole(meta.get("format_version", files.FORMAT_VERSION), "format_version")
        self.progress = TrainingProgress.from_dict(meta)
        self.config = _config_sections(meta["config"])
        self.has_optimizer = bool(meta.get("has_optimizer", True))
        self.optimizer = None if optimizer is None else OptimizerScalars.from_dict(optimizer)
        self.lr_schedule = None if lr_schedule is None else _mapping(lr_schedule, "lr_schedule")
        self.layout = CheckpointLayout.from_dict(meta.get("layout") or {})

    @classmethod
    def from_legacy(cls, main: Mapping[str, object]) -> TrainState:
        """The main file (model_optim_rng.pt) of a format-1 checkpoint: its optimizer state stays in its
        per-rank files, read by checkpoint/legacy.py."""
        return cls(
            progress=TrainingProgress.from_dict(main),
            config=_config_sections(main["config"]),
            layout=CheckpointLayout.from_dict(main.get("layout") or {}),
            lr_schedule=None if main["lr_schedule"] is None else _mapping(main["lr_schedule"], "lr_schedule"),
            has_optimizer=True,
            format_version=1,
        )


def read_train_state(iter_dir: str) -> TrainState:
    """The TrainState of the checkpoint in iter_dir (any format; its RNG states are read per rank by loader.load_rng)."""
    legacy = files.is_legacy(iter_dir)
    if legacy:
        saved = legacy_main_file(iter_dir)
        what, path = "a format-1 main file", os.path.join(rank_dir(iter_dir, 0, 0), MAIN_FILE)
    else:
        saved = files.read_meta(iter_dir)
        what, path = "a checkpoint's meta.json", os.path.join(iter_dir, files.META)
    try:  # a malformed file is one line naming it, in either format
        if legacy:
            return TrainState.from_legacy(saved)
        state = TrainState()
        state.load_state_dict(saved)
        return state
    except (KeyError, TypeError, ValueError) as err:
        raise files.CheckpointError(f"checkpoint file {path} is not {what}: {type(err).__name__} {err}") from None


def read_saved_config(iter_dir: str) -> ConfigSections:
    """The run config (Config.to_dict() form) saved with the checkpoint in iter_dir."""
    return read_train_state(iter_dir).config


def rng_path(iter_dir: str, rank: int) -> str:
    """Where rank `rank` keeps its RNG states."""
    return os.path.join(iter_dir, "rng", f"rank_{rank:05d}.pt")
