"""MoE checkpoints through the trainer: the stacked expert weights [E, ...] (and their Adam state) and the
routers' expert biases are stored as layout-free tensors under their global names. Saved at tp2 x dp2 with
sequence parallelism and the distributed optimizer (4 ranks, aux-loss-free expert bias on), a checkpoint
loads at one process and at pp2 holding exactly the saved tensors in the global view, and continues the
uninterrupted run's curve (tests/e2e/test_checkpoint_layouts.py's checks); resumed at the layout that saved
it, the run continues bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

import pretrain_gpt
from checkpoint.loader import read_global_tensors
from tests.conftest import read_metrics, run_ranks, tiny_train_args
from tests.e2e.test_checkpoint_layouts import _resume_rank, _train_rank
from tests.e2e.test_layouts import assert_matches
from tests.e2e.test_moe_layouts import EXPERT_BIAS, MOE

pytestmark = pytest.mark.tier("full")  # a 4-rank MoE checkpoint resumed at three layouts

MODEL = (*MOE, *EXPERT_BIAS, "train.eval_iters=0")
SAVED_AT = (
    "parallel.tp_size=2",
    "parallel.sequence_parallel=true",
    "parallel.distributed_optimizer=true",
)


@pytest.fixture(scope="module")
def saved_moe_run(tiny_corpus, tmp_path_factory):
    """The uninterrupted 4-rank run (10 iterations), saving at 5 and 10."""
    run_dir = str(tmp_path_factory.mktemp("saved_moe"))
    argv = [
        "--config",
        pretrain_gpt.DEFAULT_CONFIG,
        *tiny_train_args(tiny_corpus, run_dir, *MODEL, *SAVED_AT, "checkpoint.save_interval=5"),
    ]
    run_ranks(4, _train_rank, argv, timeout=600.0)
    return run_dir


@pytest.mark.parametrize(
    "world_size,layout",
    [
        pytest.param(1, (), id="one-process"),
        pytest.param(2, ("parallel.pp_size=2", "parallel.schedule=1f1b"), id="pp2"),
        pytest.param(4, SAVED_AT, id="same-layout"),
    ],
)
def test_moe_resume_at_another_layout(tiny_corpus, tmp_path, saved_moe_run, world_size, layout):
    iter5 = os.path.join(saved_moe_run, "checkpoints", "iter_0000005")
    run_dir, copy_root = str(tmp_path / "resumed"), str(tmp_path / "copy")
    overrides = tiny_train_args(tiny_corpus, run_dir, *MODEL, *layout, f"checkpoint.load={iter5}")
    run_ranks(world_size, _resume_rank, overrides, copy_root, timeout=600.0)

    saved = read_global_tensors(iter5)
    loaded = read_global_tensors(os.path.join(copy_root, "iter_0000005"))
    assert sorted(saved) == sorted(loaded)
    experts = "layers.0.mlp.experts.fc1_weight"
    assert saved[experts].ndim == 3 and f"optim.exp_avg.{experts}" in saved
    assert saved["layers.0.mlp.router.expert_bias"].any()  # stepped 5 times, saved
    for key in saved:
        assert saved[key].shape == loaded[key].shape and torch.equal(saved[key], loaded[key]), key

    expected = [r for r in read_metrics(saved_moe_run) if r["iteration"] > 5]
    resumed = read_metrics(run_dir)
    assert [r["iteration"] for r in resumed] == [6, 7, 8, 9, 10]
    if layout == SAVED_AT:  # the same layout: bit for bit
        for key in ("lm_loss", "grad_norm", "moe_load_balancing_loss", "moe_max_load"):
            assert [r[key] for r in resumed] == [r[key] for r in expected], key
    else:
        assert_matches(resumed, expected)
