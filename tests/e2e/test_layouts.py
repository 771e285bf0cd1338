"""Acceptance parity matrix: every PTD-P layout trains the same model as one process, through the real trainer.

Each case runs `pretrain_gpt.main` on forked gloo ranks (tests/conftest.run_ranks) for 10 iterations of the tiny
fp32, dropout-0 config and compares every iteration's lm_loss and global grad_norm with a single-process run of
the same arguments (relative difference <= 1e-5). The single-process references are computed once per module.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import pretrain_gpt
from tests import tiers
from tests.conftest import REPO_ROOT, read_metrics, run_ranks, tiny_train_args

pytestmark = pytest.mark.tier("fast")

RTOL = 1e-5
# No evaluation and no checkpoint in the parity runs: they cost time and add nothing to the comparison.
FAST = ("train.eval_iters=0", "checkpoint.save=false")
LLAMA = (
    "model.position_embedding_type=rope",
    "model.normalization=rmsnorm",
    "model.activation=swiglu",
    "model.num_query_groups=2",
    "model.tie_embeddings=false",
    "model.add_bias_linear=false",
)
EIGHT_LAYERS = ("model.num_layers=8",)
INTERLEAVED = ("parallel.vp_size=2", "parallel.schedule=interleaved")


def _rank_main(rank: int, world_size: int, argv: list[str]) -> None:
    if world_size == 1:
        # init_distributed gives a rank cpu_count // LOCAL_WORLD_SIZE threads: one, like the parallel ranks
        # (two OpenMP threads on 2 shared cores run this tiny model about 2x slower than one).
        os.environ["LOCAL_WORLD_SIZE"] = str(os.cpu_count() or 1)
    assert pretrain_gpt.main(argv) == 0


def train(
    corpus: dict,
    run_dir: str,
    world_size: int,
    *extra: str,
    iterations: int = 10,
    timeout: float = 240.0,
    rank_main=_rank_main,
    rank_args: tuple = (),
) -> list[dict]:
    """Run the trainer for `iterations` on world_size forked ranks (one for the single process), each rank given
    `timeout` seconds; return its training lines. `rank_main(rank, world_size, argv, *rank_args)` is the body
    (one that also measures the rank, say)."""
    args = tiny_train_args(corpus, run_dir, f"train.train_iters={iterations}", *extra)
    argv = ["--config", pretrain_gpt.DEFAULT_CONFIG, *args]
    run_ranks(world_size, rank_main, argv, *rank_args, timeout=timeout)
    records = read_metrics(run_dir)
    assert [r["iteration"] for r in records] == list(range(1, iterations + 1))
    return records


def assert_matches(
    records: list[dict], reference: list[dict], keys=("lm_loss", "grad_norm"), rtol: float = RTOL
) -> None:
    """Every iteration's value of each key within rtol (relative) of the reference."""
    for key in keys:
        for got, want in zip(records, reference, strict=True):
            diff = abs(got[key] - want[key]) / max(abs(want[key]), 1e-12)
            assert diff <= rtol, (
                f"{key} at iteration {got['iteration']}: {got[key]!r} vs single process "
                f"{want[key]!r} (relative difference {diff:.2e} > {rtol:g})"
            )


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory):
    """reference(*model_overrides) -> the single-process metrics for those model overrides, computed once."""
    cache: dict[tuple, list[dict]] = {}

    def get(*model_overrides: str) -> list[dict]:
        if model_overrides not in cache:
            run_dir = str(tmp_path_factory.mktemp("reference"))
            cache[model_overrides] = train(tiny_corpus, run_dir, 1, *FAST, *model_overrides)
        return cache[model_overrides]

    return get


# (id, world size, model overrides shared with the reference, parallel overrides)
LAYOUTS = [
    ("tp2", 2, (), ("parallel.tp_size=2",)),
    ("tp4", 4, (), ("parallel.tp_size=4",)),
    ("tp2-sp", 2, (), ("parallel.tp_size=2", "parallel.sequence_parallel=true")),
    ("tp2-llama", 2, LLAMA, ("parallel.tp_size=2",)),
    ("tp2-sp-llama", 2, LLAMA, ("parallel.tp_size=2", "parallel.sequence_parallel=true")),
    # pp=2 with 1f1b runs in test_tied_embeddings_identical_after_training_pp2 (it also saves a checkpoint)
    ("pp2-gpipe", 2, (), ("parallel.pp_size=2", "parallel.schedule=gpipe")),
    ("pp4-gpipe", 4, (), ("parallel.pp_size=4", "parallel.schedule=gpipe")),
    ("pp4-1f1b", 4, (), ("parallel.pp_size=4", "parallel.schedule=1f1b")),
    ("pp2-vp2", 2, (), ("parallel.pp_size=2", *INTERLEAVED)),
    ("pp4-vp2", 4, EIGHT_LAYERS, ("parallel.pp_size=4", *INTERLEAVED)),
    ("tp2-pp2-scatter_gather", 4, (), ("parallel.tp_size=2", "parallel.pp_size=2", "parallel.scatter_gather=true")),
    ("tp2-pp2-no_scatter_gather", 4, (), ("parallel.tp_size=2", "parallel.pp_size=2", "parallel.scatter_gather=false")),
    ("dp2", 2, (), ()),
    ("dp4", 4, (), ()),
    ("dp2-distopt", 2, (), ("parallel.distributed_optimizer=true",)),
    ("dp4-distopt", 4, (), ("parallel.distributed_optimizer=true",)),
    ("tp2-recompute_full", 2, (), ("parallel.tp_size=2", "train.recompute=full")),
    (
        "tp2-sp-recompute_selective",
        2,
        (),
        ("parallel.tp_size=2", "parallel.sequence_parallel=true", "train.recompute=selective"),
    ),
    # tp=2 x pp=2 x dp=2, vp=2, SP, distributed optimizer: test_exact_resume_at_parallel_layout
    # zero bubble: backward split into input and weight gradients (parallel/pipeline/weight_grad.py)
    ("pp2-zb-h1", 2, (), ("parallel.pp_size=2", "parallel.schedule=zb-h1")),
    ("pp4-zb-h1", 4, (), ("parallel.pp_size=4", "parallel.schedule=zb-h1")),
    ("pp2-zb-v", 2, (), ("parallel.pp_size=2", "parallel.vp_size=2", "parallel.schedule=zb-v")),
    ("pp4-zb-v", 4, EIGHT_LAYERS, ("parallel.pp_size=4", "parallel.vp_size=2", "parallel.schedule=zb-v")),
    (
        "tp2-pp2-dp2-zb-h1-sp-distopt",
        8,
        (),
        (
            "parallel.tp_size=2",
            "parallel.pp_size=2",
            "parallel.schedule=zb-h1",
            "parallel.sequence_parallel=true",
            "parallel.distributed_optimizer=true",
        ),
    ),
    ("pp2-zb-h1-recompute_full", 2, (), ("parallel.pp_size=2", "parallel.schedule=zb-h1", "train.recompute=full")),
]

# The fast tier's parity runs from this table (tests/tiers.py FAST_PARITY): tp + sp, each pipeline schedule, dp with
# the distributed optimizer and one 8-rank PTD-P run; the other layouts run in the full tier.
FAST_TIER_LAYOUTS = {"tp2-sp", "pp2-gpipe", "pp4-1f1b", "pp2-vp2", "pp2-zb-h1", "pp2-zb-v", "dp2-distopt"}
FAST_TIER_LAYOUTS |= {"tp2-pp2-dp2-zb-h1-sp-distopt"}


@pytest.mark.parametrize(
    "world_size,model_overrides,parallel_overrides",
    [tiers.layout_case(case[0], *case[1:], fast=FAST_TIER_LAYOUTS) for case in LAYOUTS],
)
def test_layout_matches_single_process(
    tiny_corpus, tmp_path, reference, world_size, model_overrides, parallel_overrides
):
    records = train(tiny_corpus, str(tmp_path / "run"), world_size, *FAST, *model_overrides, *parallel_overrides)
    assert_matches(records, reference(*model_overrides))


@pytest.mark.tier("full")
@pytest.mark.parametrize(
    "recompute",
    [
        pytest.param(
            ("train.recompute=full", "train.recompute_method=uniform", "train.recompute_num_layers=2"),
            id="full-uniform",
        ),
        pytest.param(
            ("train.recompute=full", "train.recompute_method=block", "train.recompute_num_layers=2"), id="full-block"
        ),
        pytest.param(("train.recompute=selective",), id="selective"),
    ],
)
def test_recompute_equals_no_recompute(tiny_corpus, tmp_path, reference, recompute):
    records = train(tiny_corpus, str(tmp_path / "run"), 1, *FAST, *recompute)
    assert_matches(records, reference())


@pytest.mark.tier("full")
def test_tied_embeddings_identical_after_training_pp2(tiny_corpus, tmp_path, reference):
    """pp=2, 1f1b: parity (the last stage's copy of the tied embedding produces the logits, so a copy that
    drifted from the first stage's table would show in the loss), then the checkpoint stores the tied table
    once, under the embedding's global name (tests/e2e/test_checkpoint_layouts.py loads it into both copies)."""
    from checkpoint.loader import read_global_tensors

    run_dir = str(tmp_path / "run")
    records = train(tiny_corpus, run_dir, 2, "train.eval_iters=0", "parallel.pp_size=2", "parallel.schedule=1f1b")
    assert_matches(records, reference())
    stored = read_global_tensors(os.path.join(run_dir, "checkpoints", "iter_0000010"))
    assert "output_layer.weight" not in stored and "embedding.word_embeddings.weight" in stored
    assert "optim.exp_avg.embedding.word_embeddings.weight" in stored


@pytest.mark.tier("full")
def test_overlapped_pipeline_communication_is_bitwise(tiny_corpus, tmp_path):
    """parallel.overlap_p2p_comm only moves the waits on pipeline messages: the same numbers, bit for bit."""
    layout = (*FAST, "parallel.tp_size=2", "parallel.pp_size=2", *INTERLEAVED)
    runs = [
        train(tiny_corpus, str(tmp_path / f"overlap_{flag}"), 4, *layout, f"parallel.overlap_p2p_comm={flag}")
        for flag in ("false", "true")
    ]
    for key in ("lm_loss", "grad_norm"):
        assert [r[key] for r in runs[0]] == [r[key] for r in runs[1]]


@pytest.mark.tier("full")
def test_bf16_tracks_fp32_tp2_dp2(tiny_corpus, tmp_path, reference):
    records = train(tiny_corpus, str(tmp_path / "run"), 4, *FAST, "train.precision=bf16", "parallel.tp_size=2")
    assert_matches(records, reference(), keys=("lm_loss",), rtol=2e-2)
    assert [r["lm_loss"] for r in records] != [r["lm_loss"] for r in reference()]  # bf16 really ran


@pytest.mark.tier("full")
def test_exact_resume_at_parallel_layout(tiny_corpus, tmp_path, reference):
    """tp=2 x pp=2 x dp=2 with vp=2, SP and the distributed optimizer (8 ranks): parity with one process,
    and 10 iterations straight == 5, exit, resume for 5 more, bitwise."""
    layout = (
        "train.eval_iters=0",
        "parallel.tp_size=2",
        "parallel.pp_size=2",
        *INTERLEAVED,
        "parallel.sequence_parallel=true",
        "parallel.distributed_optimizer=true",
    )
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    expected = train(tiny_corpus, whole, 8, *layout, "checkpoint.save=false")
    assert_matches(expected, reference())
    argv = [
        "--config",
        pretrain_gpt.DEFAULT_CONFIG,
        *tiny_train_args(tiny_corpus, split, *layout, "train.exit_interval=5"),
    ]
    run_ranks(8, _rank_main, argv, timeout=240.0)
    assert [r["iteration"] for r in read_metrics(split)] == [1, 2, 3, 4, 5]
    resumed = train(tiny_corpus, split, 8, *layout, "checkpoint.load=true")
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in expected]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in expected]


INVALID = [
    pytest.param(
        2,
        ("model.num_layers=6", "parallel.pp_size=2", *INTERLEAVED),
        ("model.num_layers=6", "2 * 2"),
        id="layers-not-divisible-by-pp-vp",
    ),
    pytest.param(
        2,
        ("parallel.pp_size=2", *INTERLEAVED, "train.global_batch_size=6"),
        ("micro-batches (3", "parallel.pp_size=2"),
        id="microbatches-not-multiple-of-pp",
    ),
    pytest.param(
        3, ("parallel.tp_size=3",), ("model.num_attention_heads=4", "parallel.tp_size=3"), id="tp-not-dividing-heads"
    ),
]


@pytest.mark.tier("full")  # an entry point started as a process for each bad layout (~8 CPU s)
def test_invalid_layouts_fail_before_any_work(tiny_corpus, tmp_path):
    """Exit code 2 and one line naming the values, before a process group, run dir or data exists."""
    cases = [p.values for p in INVALID]
    procs = []
    for index, (world_size, overrides, _) in enumerate(cases):
        run_dir = str(tmp_path / f"run{index}")
        env = dict(
            os.environ, WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"
        )  # an unusable port: joining it would hang or fail
        cmd = [
            sys.executable,
            os.path.join(REPO_ROOT, "pretrain_gpt.py"),
            *tiny_train_args(tiny_corpus, run_dir, *overrides),
        ]
        procs.append(
            (
                run_dir,
                subprocess.Popen(
                    cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                ),
            )
        )
    for (run_dir, proc), (_, _, expected) in zip(procs, cases):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (proc.returncode, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        for fragment in expected:
            assert fragment in lines[0], (fragment, lines[0])
        assert not os.path.exists(run_dir)
