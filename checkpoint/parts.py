"""What a full checkpoint is written from and loaded into: the parts of a built run, typed once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from checkpoint.layout import CheckpointLayout
from optim.lr_schedule import LRSchedule
from optim.optimizer import Optimizer
from parallel.random import RNGTracker
from parallel.state import ParallelState


@dataclass(frozen=True)
class CheckpointParts:
    """This rank's parallel state, model chunks, optimizer (plain or distributed), LR schedule and dropout RNG
    streams: everything besides the counters (train_state.TrainingProgress) a trainer's checkpoint holds; and
    the run's layout as checkpoints record it (saved with each one, compared on resume)."""

    state: ParallelState
    chunks: Sequence[nn.Module]
    optimizer: Optimizer
    lr_schedule: LRSchedule
    rng_tracker: RNGTracker
    layout: CheckpointLayout
