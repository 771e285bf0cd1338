"""A checkpoint written by the code before issue 18 (tests/fixtures/checkpoint_format2, made by its
make_fixture.py: tp2 x dp2 with the distributed optimizer, iteration 4) still resumes: bitwise the losses that
code computed after resuming it, at its own layout; within 1e-5 at another layout. The checkpoint this code
writes has the same keys, chunks and meta.json fields as the fixture (old code reads it the same way).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

import pretrain_gpt
from checkpoint.dcp_reader import read_dcp_metadata
from checkpoint.train_state import read_train_state
from tests.conftest import read_metrics, run_ranks

pytestmark = pytest.mark.tier("fast")

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "checkpoint_format2")
SAVED_ITER = "iter_0000004"


def _train_rank(rank: int, world_size: int, argv: list[str]) -> None:
    assert pretrain_gpt.main(argv) == 0


@pytest.fixture(scope="module")
def expected() -> dict:
    with open(os.path.join(FIXTURE, "expected.json"), encoding="utf-8") as handle:
        return json.load(handle)


def _resume(tmp_path, expected: dict, world_size: int, layout: list[str]) -> str:
    """Resume a copy of the fixture (the index caches and the new save land in tmp_path); returns run.dir."""
    corpus, checkpoints = str(tmp_path / "corpus"), str(tmp_path / "checkpoints")
    shutil.copytree(os.path.join(FIXTURE, "corpus"), corpus)
    shutil.copytree(os.path.join(FIXTURE, "checkpoints"), checkpoints)
    run_dir = str(tmp_path / "run")
    values = {"corpus": corpus, "run_dir": run_dir, "checkpoints": checkpoints}
    overrides = [o.format(**values) for o in expected["model"] + layout + expected["resume"]]
    run_ranks(world_size, _train_rank, ["--config", pretrain_gpt.DEFAULT_CONFIG, *overrides])
    return run_dir


def _losses(run_dir: str) -> dict[str, float]:
    return {str(r["iteration"]): r["lm_loss"] for r in read_metrics(run_dir)}


def _chunks(iter_dir: str) -> dict[str, list]:
    """Every stored tensor's global shape, dtype and chunks (offsets, sizes)."""
    stored = read_dcp_metadata(iter_dir).state_dict_metadata
    return {
        key: [
            list(entry.size),
            str(entry.properties.dtype),
            sorted((list(c.offsets), list(c.sizes)) for c in entry.chunks),
        ]
        for key, entry in stored.items()
    }


def test_train_state_of_the_fixture() -> None:
    saved = read_train_state(os.path.join(FIXTURE, "checkpoints", SAVED_ITER))
    assert (saved.iteration, saved.progress.consumed_samples, saved.progress.skipped_iters) == (4, 32, 0)
    assert saved.layout.sizes == (2, 1, 1, 1, 2) and saved.layout.world_size == 4
    assert saved.layout.distributed_optimizer and saved.layout.schedule is None  # not recorded then
    assert saved.layout.describe() == "tp 2 x cp 1 x pp 1 x vp 1 x dp 2 (world 4, distributed optimizer)"
    assert saved.has_optimizer and saved.optimizer is not None and saved.optimizer.step == 4
    assert saved.lr_schedule is not None and saved.config["model"]["num_layers"] == 2
    with open(os.path.join(FIXTURE, "checkpoints", SAVED_ITER, "meta.json"), encoding="utf-8") as handle:
        assert saved.state_dict() == json.load(handle)  # the schema round-trips today's meta.json


def test_resume_at_its_layout_is_bitwise(tmp_path, expected: dict) -> None:
    run_dir = _resume(tmp_path, expected, 4, expected["layout"])
    assert _losses(run_dir) == expected["lm_loss"]
    # The checkpoint this code wrote at iteration 8 is the format the fixture is: same keys, chunks, fields.
    written = os.path.join(run_dir, "checkpoints", "iter_0000008")
    fixture = os.path.join(FIXTURE, "checkpoints", SAVED_ITER)
    assert _chunks(written) == _chunks(fixture)
    with open(os.path.join(written, "meta.json"), encoding="utf-8") as a, open(os.path.join(fixture, "meta.json")) as b:
        assert json.load(a).keys() == json.load(b).keys()
    assert sorted(os.listdir(os.path.join(written, "rng"))) == sorted(os.listdir(os.path.join(fixture, "rng")))


def test_resume_at_another_layout(tmp_path, expected: dict) -> None:
    run_dir = _resume(tmp_path, expected, 2, ["parallel.pp_size=2"])
    losses = _losses(run_dir)
    assert losses.keys() == expected["lm_loss"].keys()
    for iteration, loss in expected["lm_loss"].items():
        assert losses[iteration] == pytest.approx(loss, rel=1e-5, abs=0), iteration
