"""Sharded data parallelism (parallel.fsdp, FSDP2) through the real trainer: every FSDP layout trains the same model
as one process (10 iterations of the tiny fp32 config, lm_loss and grad_norm within 1e-5 of test_layouts'
single-process references, shared through its module fixture), mixed precision tracks fp32, and checkpoints stay
layout-free: an FSDP run resumes bitwise at its own layout and within 1e-5 at tp2 x pp2 and at one process, and
PTD-P / HSDP checkpoints resume under FSDP (and back). Runs that save evaluate too (the default path): FSDP's
forward-only pass must leave the shards in place for the save that follows it."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import pretrain_gpt
from tests import tiers
from tests.conftest import read_metrics, run_ranks, tiny_train_args
from tests.e2e.test_layouts import FAST, _rank_main, assert_matches, reference, train

pytestmark = pytest.mark.tier("fast")

__all__ = ["reference"]  # test_layouts' single-process runs, cached per overrides, used here too

FSDP = ("parallel.fsdp=true",)
SEQ_256 = ("model.seq_length=256",)  # context parallelism cuts each sequence into 2 * cp chunks
NO_RESHARD = ("parallel.fsdp_reshard_after_forward=false",)
HSDP = ("parallel.fsdp_replicate=2",)
TP2_SP = ("parallel.tp_size=2", "parallel.sequence_parallel=true")

# (id, world size, model overrides shared with the reference, parallel overrides)
FSDP_LAYOUTS = [
    ("fsdp-dp4", 4, (), FSDP),
    ("fsdp-dp4-no-reshard", 4, (), (*FSDP, *NO_RESHARD)),
    ("fsdp-dp2-tp2-sp", 4, (), (*FSDP, *TP2_SP)),
    ("fsdp-dp2-tp2-sp-no-reshard", 4, (), (*FSDP, *TP2_SP, *NO_RESHARD)),
    ("fsdp-dp2-cp2", 4, SEQ_256, (*FSDP, "parallel.cp_size=2")),
    ("hsdp-2x2", 4, (), (*FSDP, *HSDP)),
    ("hsdp-2x1", 2, (), (*FSDP, *HSDP)),  # shard groups of one rank: the replicas' all-reduce alone reduces
    ("hsdp-4x1", 4, (), (*FSDP, "parallel.fsdp_replicate=4")),
    ("fsdp-dp4-recompute-full", 4, (), (*FSDP, "train.recompute=full")),
]


@pytest.mark.parametrize(
    "world_size,model_overrides,parallel_overrides",
    # fsdp-dp4 and hsdp-2x2: the fast tier's FSDP and HSDP runs (tests/tiers.py FAST_PARITY); hsdp-2x1: one-rank
    # shard groups, whose gradients were once averaged twice
    [tiers.layout_case(case[0], *case[1:], fast={"fsdp-dp4", "hsdp-2x2", "hsdp-2x1"}) for case in FSDP_LAYOUTS],
)
def test_fsdp_matches_single_process(tiny_corpus, tmp_path, reference, world_size, model_overrides, parallel_overrides):
    records = train(tiny_corpus, str(tmp_path / "run"), world_size, *FAST, *model_overrides, *parallel_overrides)
    assert_matches(records, reference(*model_overrides))


@pytest.mark.tier("full")
@pytest.mark.parametrize(
    "precision",
    [
        pytest.param(("train.precision=bf16",), id="bf16"),
        pytest.param(("train.precision=fp16", "optim.initial_loss_scale=128"), id="fp16"),
    ],
)
def test_mixed_precision_tracks_fp32(tiny_corpus, tmp_path, reference, precision):
    """bf16 / fp16 compute on fp32 shards, fp32 gradient reduction (fp16: the loss scaler's check over the
    shards): close to the fp32 run, and really in 16 bits."""
    records = train(tiny_corpus, str(tmp_path / "run"), 4, *FAST, *FSDP, *TP2_SP, *precision)
    assert_matches(records, reference(), keys=("lm_loss",), rtol=2e-2)
    assert [r["lm_loss"] for r in records] != [r["lm_loss"] for r in reference()]


def _split(corpus: dict, run_dir: str, world_size: int, *layout: str) -> str:
    """Train 5 iterations, evaluate, and stop with a checkpoint; returns its checkpoints folder."""
    argv = [
        "--config",
        pretrain_gpt.DEFAULT_CONFIG,
        *tiny_train_args(corpus, run_dir, *layout, "train.exit_interval=5"),
    ]
    run_ranks(world_size, _rank_main, argv, timeout=240.0)
    assert [r["iteration"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert [r["iteration"] for r in _validation_records(run_dir)] == [0, 5]  # the save came after an evaluation
    return os.path.join(run_dir, "checkpoints")


def _validation_records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        return [r for r in map(json.loads, handle) if "val_loss" in r]


def _resume(corpus: dict, checkpoints: str, run_dir: str, world_size: int, *layout: str) -> list[dict]:
    """Resume a copy of `checkpoints` on world_size ranks; the training lines of iterations 6-10."""
    shutil.copytree(checkpoints, os.path.join(run_dir, "checkpoints"))
    argv = [
        "--config",
        pretrain_gpt.DEFAULT_CONFIG,
        *tiny_train_args(corpus, run_dir, *layout, "checkpoint.load=true"),
    ]
    run_ranks(world_size, _rank_main, argv, timeout=240.0)
    resumed = read_metrics(run_dir)
    assert [r["iteration"] for r in resumed] == [6, 7, 8, 9, 10]
    return resumed


@pytest.mark.tier("full")
def test_fsdp_checkpoint_resumes_bitwise_and_at_ptdp_layouts(tiny_corpus, tmp_path, reference):
    """Saved by FSDP dp4 at iteration 5: resumed by FSDP dp4 bit for bit against the uninterrupted run (which
    evaluates too: FSDP's forward-only pass), and by tp2 x pp2 and by one process within 1e-5."""
    whole = train(tiny_corpus, str(tmp_path / "whole"), 4, *FSDP, "checkpoint.save=false")
    assert_matches(whole, reference())
    checkpoints = _split(tiny_corpus, str(tmp_path / "split"), 4, *FSDP)
    same = _resume(tiny_corpus, checkpoints, str(tmp_path / "same"), 4, *FSDP)
    for key in ("lm_loss", "grad_norm"):
        assert [r[key] for r in same] == [r[key] for r in whole[5:]]
    for name, world_size, layout in (
        ("tp2-pp2", 4, ("parallel.tp_size=2", "parallel.pp_size=2")),
        ("one-process", 1, ()),
    ):
        assert_matches(_resume(tiny_corpus, checkpoints, str(tmp_path / name), world_size, *layout), whole[5:])


@pytest.mark.tier("full")
def test_ptdp_checkpoint_resumes_under_fsdp_and_hsdp_checkpoint_at_one_process(tiny_corpus, tmp_path, reference):
    """The reverse: a tp2 x pp2 checkpoint resumes under FSDP dp4 and under HSDP 2 x 2 at tp 2 with sequence parallelism, 8 ranks (each within
    1e-5 of one process), and a checkpoint HSDP wrote (shards dealt over its replicas) resumes at one process."""
    expected = reference()[5:]
    ptdp = _split(tiny_corpus, str(tmp_path / "ptdp"), 4, "parallel.tp_size=2", "parallel.pp_size=2")
    assert_matches(_resume(tiny_corpus, ptdp, str(tmp_path / "fsdp"), 4, *FSDP), expected)
    assert_matches(_resume(tiny_corpus, ptdp, str(tmp_path / "hsdp-tp2"), 8, *FSDP, *HSDP, *TP2_SP), expected)
    hsdp = _split(tiny_corpus, str(tmp_path / "hsdp"), 4, *FSDP, *HSDP)
    assert_matches(_resume(tiny_corpus, hsdp, str(tmp_path / "one"), 1), expected)


def test_fsdp_dp2_checkpoint_saved_after_evaluation_resumes_at_one_process(tiny_corpus, tmp_path, reference):
    """FSDP dp2 evaluates at iteration 5 and then saves (its root unit keeps its gathered parameters after a
    forward, and a no_grad forward has no backward to free them): the checkpoint resumes at one process within
    1e-5 of the uninterrupted single-process run."""
    checkpoints = _split(tiny_corpus, str(tmp_path / "split"), 2, *FSDP)
    assert_matches(_resume(tiny_corpus, checkpoints, str(tmp_path / "one"), 1), reference()[5:])


# (id, world size, overrides): every data-parallel flavour, FSDP's with and without resharding after forward
DP_FLAVOURS = [
    ("dp2", 2, ()),
    ("dp2-distributed-optimizer", 2, ("parallel.distributed_optimizer=true",)),
    ("fsdp-dp2", 2, FSDP),
    ("fsdp-dp2-no-reshard", 2, (*FSDP, *NO_RESHARD)),
    ("hsdp-2x2", 4, (*FSDP, *HSDP)),
    ("hsdp-2x1-no-reshard", 2, (*FSDP, *HSDP, *NO_RESHARD)),
]


@pytest.mark.tier("full")  # six flavours x 3 saves; the fast tier keeps the FSDP dp2 save-after-evaluation resume
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_dp_flavour_saves_right_after_evaluation(tiny_corpus, tmp_path, precision):
    """Evaluation and a save at every iteration (3 iterations): each flavour exits 0 with a checkpoint per
    iteration, and the weights saved last (after two evaluations and saves) are plain dp2's, within 1e-5 in
    fp32 (bf16: within its rounding, 2e-2)."""
    from checkpoint import read_global_tensors

    cadence = ("train.train_iters=3", "train.eval_interval=1", "train.eval_iters=1", "checkpoint.save_interval=1")
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for name, world_size, flavour in DP_FLAVOURS:
        run_dir = str(tmp_path / name)
        argv = [
            "--config",
            pretrain_gpt.DEFAULT_CONFIG,
            *tiny_train_args(tiny_corpus, run_dir, *cadence, f"train.precision={precision}", *flavour),
        ]
        run_ranks(world_size, _rank_main, argv, timeout=240.0)  # each rank asserts exit code 0
        assert [r["iteration"] for r in _validation_records(run_dir)] == [0, 1, 2, 3], name
        checkpoints = os.path.join(run_dir, "checkpoints")
        assert sorted(p for p in os.listdir(checkpoints) if p.startswith("iter_")) == [
            "iter_0000001",
            "iter_0000002",
            "iter_0000003",
        ], name
        stored = read_global_tensors(os.path.join(checkpoints, "iter_0000003"))
        saved[name] = {key: tensor for key, tensor in stored.items() if not key.startswith("optim.")}
    rtol = 1e-5 if precision == "fp32" else 2e-2
    expected = saved["dp2"]
    for name, weights in saved.items():
        assert weights.keys() == expected.keys(), name
        for key, tensor in weights.items():
            # .float(): under bf16, DataParallel stores bf16 weights, FSDP its fp32 shards (the masters)
            got, want = tensor.float(), expected[key].float()
            torch.testing.assert_close(got, want, rtol=rtol, atol=rtol, msg=f"{name}: {key}")
