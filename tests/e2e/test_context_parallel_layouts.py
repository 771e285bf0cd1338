"""Context parallelism through the real trainer: every cp layout trains the same model as one process (10
iterations of the tiny fp32 config at seq 256, lm_loss and grad_norm within 1e-5), and a checkpoint saved at
cp2 x tp2 resumes at cp1 and at cp4 on the uninterrupted run's losses."""

from __future__ import annotations

import os
import shutil

import pytest

import pretrain_gpt
from tests import tiers
from tests.conftest import run_ranks, tiny_train_args
from tests.e2e.test_layouts import FAST, LLAMA, _rank_main, assert_matches, reference, train

pytestmark = pytest.mark.tier("fast")

# `reference` (the single-process runs, cached per overrides) is test_layouts' module fixture, used here too
__all__ = ["reference"]

SEQ_256 = ("model.seq_length=256",)
DOCUMENTS = ("data.reset_attention_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true")


CP_LAYOUTS = [
    ("cp2", 2, (), ("parallel.cp_size=2",)),
    ("cp4", 4, (), ("parallel.cp_size=4",)),
    ("cp2-tp2-sp", 4, (), ("parallel.cp_size=2", "parallel.tp_size=2", "parallel.sequence_parallel=true")),
    (
        "cp2-pp2-dp2-distopt",
        8,
        (),
        ("parallel.cp_size=2", "parallel.pp_size=2", "parallel.distributed_optimizer=true"),
    ),
    ("cp2-llama", 2, LLAMA, ("parallel.cp_size=2",)),
    ("cp2-documents", 2, DOCUMENTS, ("parallel.cp_size=2",)),
    ("cp2-selective-recompute", 2, (), ("parallel.cp_size=2", "train.recompute=selective")),
]


@pytest.mark.parametrize(
    "world_size,model_overrides,parallel_overrides",
    [tiers.layout_case(case[0], *case[1:], fast={"cp2"}) for case in CP_LAYOUTS],  # cp2: the fast tier's cp run
)
def test_context_parallel_matches_single_process(
    tiny_corpus, tmp_path, reference, world_size, model_overrides, parallel_overrides
):
    run_dir = str(tmp_path / "run")
    records = train(tiny_corpus, run_dir, world_size, *FAST, *SEQ_256, *model_overrides, *parallel_overrides)
    assert_matches(records, reference(*SEQ_256, *model_overrides))


@pytest.mark.tier("full")
def test_checkpoint_at_cp2_tp2_resumes_at_cp1_and_cp4(tiny_corpus, tmp_path, reference):
    """Saved at iteration 5 by cp2 x tp2 (4 ranks); resumed by one process and by cp4: iterations 6-10
    within 1e-5 of the uninterrupted cp2 x tp2 run (which itself matches one process)."""
    layout = ("train.eval_iters=0", *SEQ_256, "parallel.cp_size=2", "parallel.tp_size=2")
    whole = train(tiny_corpus, str(tmp_path / "whole"), 4, *layout, "checkpoint.save=false")
    assert_matches(whole, reference(*SEQ_256))
    split = str(tmp_path / "split")
    argv = [
        "--config",
        pretrain_gpt.DEFAULT_CONFIG,
        *tiny_train_args(tiny_corpus, split, *layout, "train.exit_interval=5"),
    ]
    run_ranks(4, _rank_main, argv, timeout=240.0)
    for world_size, cp in ((1, 1), (4, 4)):
        resumed_dir = str(tmp_path / f"resume_cp{cp}")
        shutil.copytree(os.path.join(split, "checkpoints"), os.path.join(resumed_dir, "checkpoints"))
        resumed = train_from(
            tiny_corpus, resumed_dir, world_size, "train.eval_iters=0", *SEQ_256, f"parallel.cp_size={cp}"
        )
        assert [r["iteration"] for r in resumed] == list(range(6, 11))
        assert_matches(resumed, whole[5:])


def train_from(corpus: dict, run_dir: str, world_size: int, *extra: str) -> list[dict]:
    """Resume the checkpoint in run_dir on world_size ranks; the training lines it wrote."""
    from tests.conftest import read_metrics

    argv = ["--config", pretrain_gpt.DEFAULT_CONFIG, *tiny_train_args(corpus, run_dir, *extra, "checkpoint.load=true")]
    run_ranks(world_size, _rank_main, argv, timeout=240.0)
    return read_metrics(run_dir)
