"""The layout a checkpoint records (checkpoint/train_state.CheckpointLayout): meta.json's "layout" of
every earlier writer reads and writes back unchanged, one describe() for every report, bad values refused."""

from __future__ import annotations

import json
import os

import pytest

from checkpoint import files
from checkpoint.files import CheckpointError
from checkpoint.layout import CheckpointLayout
from checkpoint.train_state import read_train_state
from parallel.state import ParallelState

pytestmark = pytest.mark.tier("fast")

FORMAT2 = {  # tests/fixtures/checkpoint_format2: no cp (written before context parallelism), no schedule
    "distributed_optimizer": True,
    "dp": 2,
    "pp": 1,
    "sequence_parallel": False,
    "tp": 2,
    "vp": 1,
    "world_size": 4,
}


@pytest.mark.parametrize(
    "saved",
    [FORMAT2, {**FORMAT2, "cp": 2, "schedule": "interleaved"}, {**FORMAT2, "ep": 2}, {"tp": 2, "pp": 2, "vp": 1}, {}],
    ids=["format2", "cp-and-schedule", "ep", "format1", "nothing"],
)
def test_recorded_layouts_round_trip(saved: dict) -> None:
    assert CheckpointLayout.from_dict(saved).to_dict() == saved


def test_describe() -> None:
    assert CheckpointLayout.from_dict(FORMAT2).describe() == (
        "tp 2 x cp 1 x pp 1 x vp 1 x dp 2 (world 4, distributed optimizer)"
    )
    cp = CheckpointLayout.from_dict({**FORMAT2, "cp": 2, "schedule": "interleaved", "sequence_parallel": True})
    assert cp.describe() == (
        "tp 2 x cp 2 x pp 1 x vp 1 x dp 2 (world 4, schedule interleaved, sequence parallel, distributed optimizer)"
    )
    assert CheckpointLayout.from_dict({**FORMAT2, "ep": 2}).describe() == (
        "tp 2 x cp 1 x pp 1 x vp 1 x dp 2 (world 4, experts over ep 2, distributed optimizer)"
    )
    assert CheckpointLayout.from_dict({"tp": 2, "pp": 2, "vp": 1}).describe() == "tp 2 x cp 1 x pp 2 x vp 1 x dp ?"
    assert CheckpointLayout.from_dict({}).describe() == "an unknown layout"


def test_a_run_records_its_sizes_and_schedule() -> None:
    layout = CheckpointLayout.of(ParallelState.single(), False, True, "1f1b")
    assert layout.to_dict() == {
        "tp": 1,
        "pp": 1,
        "vp": 1,
        "dp": 1,
        "world_size": 1,
        "schedule": "1f1b",
        "sequence_parallel": False,
        "distributed_optimizer": True,
    }
    # RNG streams carry over at the same sizes, whatever else differs (a format-2 layout without cp: cp 1)
    assert layout.same_sizes(CheckpointLayout.from_dict({"tp": 1, "pp": 1, "vp": 1, "dp": 1}))
    assert not layout.same_sizes(CheckpointLayout.from_dict({"tp": 1, "pp": 1, "vp": 1, "dp": 1, "cp": 2}))
    assert not layout.same_sizes(CheckpointLayout.from_dict({"tp": 1, "pp": 1, "vp": 1}))  # dp unknown


@pytest.mark.parametrize(
    "saved,message",
    [
        ({"tp": "2"}, "layout tp='2' is not a whole number >= 1"),
        ({"tp": 0}, "layout tp=0 is not a whole number >= 1"),
        ({"dp": True}, "layout dp=True is not a whole number >= 1"),
        ({"tp": 1, "sequence_parallel": 1}, "layout sequence_parallel=1 is not a bool"),
        ({"tp": 1, "schedule": 3}, "layout schedule=3 is not a str"),
        ({"tp": 1, "ep": 0}, "layout ep=0 is not a whole number >= 1"),
    ],
)
def test_bad_values_are_refused(saved: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointLayout.from_dict(saved)


def test_a_bad_layout_in_meta_json_is_one_line(tmp_path) -> None:
    meta = {"format_version": 2, "iteration": 3, "config": {}, "layout": ["tp", 2]}
    (tmp_path / files.META).write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"is not a checkpoint's meta.json: TypeError the layout is list"):
        read_train_state(str(tmp_path))


def test_a_malformed_format1_main_file_is_one_line(tmp_path) -> None:
    """The per-rank format of earlier versions: a main file whose config is not a mapping names the file."""
    import torch

    from checkpoint.folder_names import MAIN_FILE
    from checkpoint.legacy import rank_dir

    main_dir = rank_dir(str(tmp_path), 0, 0)
    os.makedirs(main_dir)
    torch.save({"iteration": 3, "config": "not a mapping", "lr_schedule": None}, os.path.join(main_dir, MAIN_FILE))
    assert files.is_legacy(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"model_optim_rng.pt is not a format-1 main file: TypeError"):
        read_train_state(str(tmp_path))
