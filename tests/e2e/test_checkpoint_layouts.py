"""Layout-free checkpoints through the trainer: save at tp2 x pp2 x vp2 x dp2 with the distributed optimizer
(8 ranks), resume at other layouts. Each resume continues the curve of the uninterrupted 8-rank run (rtol 1e-5
over the 5 iterations after the resume) and holds, right after loading, exactly the saved Adam state and weights
in the global view (the resumed run saves a copy before it trains; every tensor of both checkpoints is equal).
Every pipeline schedule as a load target (zb-v's V placement included): tests/e2e/test_checkpoint_schedules.py.
"""

from __future__ import annotations

import os

import pytest
import torch

import pretrain_gpt
from checkpoint.loader import read_global_tensors
from checkpoint.saver import write_checkpoint
from config.schema import load_config
from operations.startup import init_distributed
from parallel.layout import layout_from_config
from tests.conftest import read_metrics, run_ranks, tiny_train_args
from tests.e2e.test_layouts import assert_matches
from training.loop import train
from training.run import build_run, resume_if_asked

pytestmark = pytest.mark.tier("full")  # an 8-rank checkpoint resumed at five layouts

MODEL = ("model.num_layers=8", "train.eval_iters=0")
SAVED_AT = (
    "parallel.tp_size=2",
    "parallel.pp_size=2",
    "parallel.vp_size=2",
    "parallel.schedule=interleaved",
    "parallel.distributed_optimizer=true",
)
TARGETS = [
    pytest.param(1, (), id="one-process"),
    pytest.param(4, ("parallel.tp_size=4",), id="tp4"),
    pytest.param(4, ("parallel.pp_size=4", "parallel.vp_size=2", "parallel.schedule=interleaved"), id="pp4-vp2"),
    pytest.param(4, (), id="dp4-plain-optimizer"),
    pytest.param(4, ("parallel.tp_size=2", "parallel.sequence_parallel=true"), id="tp2-dp2-sp"),
]


def _train_rank(rank: int, world_size: int, argv: list[str]) -> None:
    if world_size == 1:
        os.environ["LOCAL_WORLD_SIZE"] = str(os.cpu_count() or 1)
    assert pretrain_gpt.main(argv) == 0


def _resume_rank(rank: int, world_size: int, overrides: list[str], copy_root: str) -> None:
    """The trainer's own steps, plus a save of what was loaded (before any training) into copy_root."""
    from checkpoint import build_save_job

    if world_size == 1:
        os.environ["LOCAL_WORLD_SIZE"] = str(os.cpu_count() or 1)
    config = load_config(pretrain_gpt.DEFAULT_CONFIG, overrides)
    run = build_run(config, init_distributed(), layout_from_config(config, world_size))
    resume_if_asked(run)
    assert run.progress.iteration == 5
    job = build_save_job(copy_root, run.checkpoint_parts(), run.progress, run.config.to_dict(), keep_last=0)
    os.makedirs(copy_root, exist_ok=True)
    write_checkpoint(job, run.checkpointer.group)
    train(run)


@pytest.fixture(scope="module")
def saved_run(tiny_corpus, tmp_path_factory):
    """The uninterrupted 8-rank run (10 iterations), saving at 5 and 10."""
    run_dir = str(tmp_path_factory.mktemp("saved8"))
    argv = [
        "--config",
        pretrain_gpt.DEFAULT_CONFIG,
        *tiny_train_args(tiny_corpus, run_dir, *MODEL, *SAVED_AT, "checkpoint.save_interval=5"),
    ]
    run_ranks(8, _train_rank, argv, timeout=600.0)
    return run_dir


@pytest.mark.parametrize("world_size,layout", TARGETS)
def test_resume_at_another_layout(tiny_corpus, tmp_path, saved_run, world_size, layout):
    iter5 = os.path.join(saved_run, "checkpoints", "iter_0000005")
    run_dir, copy_root = str(tmp_path / "resumed"), str(tmp_path / "copy")
    overrides = tiny_train_args(tiny_corpus, run_dir, *MODEL, *layout, f"checkpoint.load={iter5}")
    run_ranks(world_size, _resume_rank, overrides, copy_root, timeout=600.0)

    expected = [r for r in read_metrics(saved_run) if r["iteration"] > 5]
    resumed = read_metrics(run_dir)
    assert [r["iteration"] for r in resumed] == [6, 7, 8, 9, 10]
    assert_matches(resumed, expected)

    saved = read_global_tensors(iter5)
    loaded = read_global_tensors(os.path.join(copy_root, "iter_0000005"))
    assert sorted(saved) == sorted(loaded)
    assert any(key.startswith("optim.exp_avg_sq.") for key in saved)
    for key in saved:
        assert saved[key].shape == loaded[key].shape and torch.equal(saved[key], loaded[key]), key
