"""MoE checkpoints through the trainer: the stacked expert weights [E, ...] (and their Adam state) and the
routers' expert biases are stored as layout-free tensors under their global names, each ep rank writing its
experts' rows. Saved at ep2 x tp2 (dp2) with sequence parallelism and the distributed optimizer (4 ranks,
configs/moe_tiny.yaml's model with the aux-loss-free expert bias on), a checkpoint loads at one process (ep1)
and at ep4 x pp2 (8 ranks) holding exactly the saved tensors in the global view, and continues the
uninterrupted run's curve (tests/e2e/test_checkpoint_layouts.py's checks); resumed at the layout that saved
it, the run continues bit for bit.
"""

from __future__ import annotations

import json
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
    "parallel.ep_size=2",
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
        pytest.param(8, ("parallel.ep_size=4", "parallel.pp_size=2", "parallel.schedule=1f1b"), id="ep4-pp2"),
        pytest.param(4, SAVED_AT, id="same-layout"),
    ],
)
def test_moe_resume_at_another_layout(tiny_corpus, tmp_path, saved_moe_run, world_size, layout):
    iter5 = os.path.join(saved_moe_run, "checkpoints", "iter_0000005")
    run_dir, copy_root = str(tmp_path / "resumed"), str(tmp_path / "copy")
    overrides = tiny_train_args(tiny_corpus, run_dir, *MODEL, *layout, f"checkpoint.load={iter5}")
    run_ranks(world_size, _resume_rank, overrides, copy_root, timeout=600.0)

    with open(os.path.join(iter5, "meta.json"), encoding="utf-8") as handle:
        assert json.load(handle)["layout"]["ep"] == 2
    saved = read_global_tensors(iter5)
    loaded = read_global_tensors(os.path.join(copy_root, "iter_0000005"))
    assert sorted(saved) == sorted(loaded)
    experts = "layers.0.mlp.experts.fc1_weight"
    assert saved[experts].shape[0] == 8 and f"optim.exp_avg.{experts}" in saved  # every expert, whole
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


def _greedy_on_ranks(rank: int, world_size: int, checkpoint: str, out_file: str) -> None:
    from operations.startup import DistEnv
    from tests.tools.test_generate import greedy_tokens

    tokens = greedy_tokens(checkpoint, DistEnv(world_size, rank, rank, world_size, torch.device("cpu")), 20)
    if rank == 0:
        torch.save(tokens, out_file)


def test_an_ep2_checkpoint_generates_and_evaluates(tiny_corpus, tmp_path, capsys):
    """A checkpoint trained at ep2 (moe_tiny's MoE keys on the tiny test model, 4 iterations, validated at the
    last one) is no ep2 model to the tools: tools/generate.py takes no layout overrides (it runs tp over its
    ranks), and its greedy tokens on one process equal those at tp2 on 2 ranks; tools/evaluate.py's loss over
    the validation split equals the trainer's val_loss at ep2, and its wikitext figures come out finite."""
    import math

    from tests.e2e.test_moe_layouts import moe_tiny_overrides
    from tests.evaluation.conftest import WIKITEXT
    from tools import evaluate as evaluate_tool

    run_dir = str(tmp_path / "run")
    argv = tiny_train_args(
        tiny_corpus,
        run_dir,
        *moe_tiny_overrides(),
        "parallel.ep_size=2",
        "train.train_iters=4",
        "train.eval_interval=4",
        "checkpoint.save_interval=4",
    )
    run_ranks(2, _train_rank, ["--config", pretrain_gpt.DEFAULT_CONFIG, *argv], timeout=600.0)
    checkpoint = os.path.join(run_dir, "checkpoints")
    single = os.path.join(str(tmp_path), "single.pt")
    run_ranks(1, _greedy_on_ranks, checkpoint, single)
    run_ranks(2, _greedy_on_ranks, checkpoint, str(tmp_path / "tp2.pt"))
    # greedy decoding stops early at the end-of-document token (12 tokens here, measured)
    assert torch.load(single) and torch.load(single) == torch.load(tmp_path / "tp2.pt")

    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    val_loss = [record["val_loss"] for record in records if "val_loss" in record][-1]
    capsys.readouterr()
    data = tiny_corpus["data_prefix"]
    args = ["loss", "--data", data, "--checkpoint", checkpoint, "--split", "valid", "--batches", "2", "--json"]
    assert evaluate_tool.main(args) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(val_loss, rel=1e-6)
    wikitext = tmp_path / "wiki.test.tokens"
    wikitext.write_text(WIKITEXT, encoding="utf-8")
    args = ["wikitext", "--data", str(wikitext), "--checkpoint", checkpoint, "--json"]
    assert evaluate_tool.main(args) == 0, capsys.readouterr().err
    figures = json.loads(capsys.readouterr().out)
    assert math.isfinite(figures["loss"]) and figures["tokens"] > 0
