"""The layout a checkpoint was written at, as one typed record: `CheckpointLayout`, a field of
checkpoint/train_state.TrainState (meta.json's "layout"), built once by the run
(training/run.Run.checkpoint_parts) and read by the resume (the RNG streams) and every report of a stored layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from parallel.state import ParallelState

SIZE_NAMES = ("tp", "cp", "pp", "vp", "dp")  # CheckpointLayout.sizes, in this order
LayoutJson = dict[str, int | str | bool]  # meta.json's "layout": the recorded fields
Field = TypeVar("Field", int, str, bool)


def _recorded(saved: Mapping[str, object], name: str, kind: type[Field]) -> Field | None:
    """The value `saved` records for field `name` (None: not recorded); ValueError when it is not a `kind`
    (int: a whole number >= 1)."""
    value = saved.get(name)
    if value is None or (isinstance(value, kind) and (kind is not int or (type(value) is int and value >= 1))):
        return value
    wanted = "whole number >= 1" if kind is int else kind.__name__
    raise ValueError(f"layout {name}={value!r} is not a {wanted}")


@dataclass(frozen=True)
class CheckpointLayout:
    """The layout a checkpoint was written at: informational (a layout-free checkpoint loads at any layout),
    except that each rank's dropout RNG streams continue only at the same sizes (`same_sizes`).

    meta.json's "layout" holds the recorded fields (`to_dict` / `from_dict`, the keys of format 2): a field an
    older writer did not record is None and stays out of the file; `cp` and `ep` are there only when > 1 (written
    before context or expert parallelism: 1). A format-1 checkpoint records tp, pp and vp only, or nothing at all.
    `ep` (experts over ep ranks) is informational only: expert weights are stored whole and the RNG streams do
    not depend on it.
    """

    tp: int | None = None
    cp: int = 1
    pp: int | None = None
    vp: int | None = None
    dp: int | None = None
    world_size: int | None = None
    schedule: str | None = None  # the schedule that ran (parallel/layout.effective_schedule)
    sequence_parallel: bool | None = None
    distributed_optimizer: bool | None = None
    ep: int = 1

    @classmethod
    def of(
        cls, state: ParallelState, sequence_parallel: bool, distributed_optimizer: bool, schedule: str | None
    ) -> CheckpointLayout:
        """The layout this run records: its sizes (from `state`), parallel.sequence_parallel,
        parallel.distributed_optimizer and the schedule that runs (None: a weights-only save records none)."""
        return cls(
            tp=state.tp_size,
            cp=state.cp_size,
            pp=state.pp_size,
            vp=state.vp_size,
            dp=state.dp_size,
            world_size=state.world_size,
            schedule=schedule,
            sequence_parallel=bool(sequence_parallel),
            distributed_optimizer=bool(distributed_optimizer),
            ep=state.ep_size,
        )

    def to_dict(self) -> LayoutJson:
        """meta.json's "layout": the recorded fields (cp and ep only when > 1, as since format 2)."""
        recorded = dataclasses.asdict(self)
        for size in ("cp", "ep"):
            if recorded[size] == 1:
                del recorded[size]
        return {key: value for key, value in recorded.items() if value is not None}

    @classmethod
    def from_dict(cls, saved: object) -> CheckpointLayout:
        """The layout a meta.json (or a format-1 main file) records; keys of other writers are ignored.
        TypeError / ValueError for a value of the wrong kind."""
        if not isinstance(saved, dict):
            raise TypeError(f"the layout is {type(saved).__name__}, not a mapping")
        return cls(  # fields in order: the first wrong one is named
            tp=_recorded(saved, "tp", int),
            cp=_recorded(saved, "cp", int) or 1,
            pp=_recorded(saved, "pp", int),
            vp=_recorded(saved, "vp", int),
            dp=_recorded(saved, "dp", int),
            world_size=_recorded(saved, "world_size", int),
            schedule=_recorded(saved, "schedule", str),
            sequence_parallel=_recorded(saved, "sequence_parallel", bool),
            distributed_optimizer=_recorded(saved, "distributed_optimizer", bool),
            ep=_recorded(saved, "ep", int) or 1,
        )

    @property
    def sizes(self) -> tuple[int | None, ...]:
        """(tp, cp, pp, vp, dp): what decides whether each rank's RNG streams carry over."""
        return self.tp, self.cp, self.pp, self.vp, self.dp

    def same_sizes(self, other: CheckpointLayout) -> bool:
        """Whether both record the same (tp, cp, pp, vp, dp), every one known."""
        return None not in self.sizes and self.sizes == other.sizes

    def describe(self) -> str:
        """The layout as words ("tp 2 x cp 2 x pp 1 x vp 1 x dp 1 (world 4, sequence parallel)"); every report
        of a stored layout uses this one. Sizes not recorded show as "?"; nothing recorded (format 1) says so."""
        if self.tp is None:
            return "an unknown layout"
        sizes = " x ".join(f"{name} {'?' if size is None else size}" for name, size in zip(SIZE_NAMES, self.sizes))
        extras = [f"world {self.world_size}"] if self.world_size is not None else []
        extras += [f"experts over ep {self.ep}"] if self.ep > 1 else []
        extras += [f"schedule {self.schedule}"] if self.schedule is not None else []
        extras += [
            name.replace("_", " ") for name in ("sequence_parallel", "distributed_optimizer") if getattr(self, name)
        ]
        return sizes + (f" ({', '.join(extras)})" if extras else "")
