"""The planner charges the collectives the trainer runs: planner/collectives.py's list for a layout equals, rank by
rank, what a real run issued in one training iteration (parallel/comm.py's recorder on gloo), exactly: kind,
group, group size and bytes."""

import json
import os
from collections import Counter

import pytest

import pretrain_gpt
from config.schema import load_config
from operations.startup import init_distributed
from parallel.comm_recorder import CommRecorder
from parallel.layout import layout_from_config
from planner.collectives import LayoutCollectives
from tests import tiers
from tests.conftest import run_ranks, tiny_train_args
from training.loop import train
from training.run import build_run

pytestmark = pytest.mark.tier("fast")

RECORDED_ITERATION = 2  # the second iteration: the first one is no different, but this proves it is per iteration

LAYOUTS = [
    ("tp2-pp2-dp2-distopt", 8, ["parallel.tp_size=2", "parallel.pp_size=2", "parallel.distributed_optimizer=true"]),
    ("interleaved-pp2-vp2", 2, ["parallel.pp_size=2", "parallel.vp_size=2", "parallel.schedule=interleaved"]),
    ("zb-v-pp2-tied", 2, ["parallel.pp_size=2", "parallel.vp_size=2", "parallel.schedule=zb-v"]),
    ("cp2-dp2", 4, ["parallel.cp_size=2"]),
    # beyond the four: sequence parallelism and recomputation (full, selective), scatter/gather off, fp16's
    # inf check, bf16, hidden dropout (which makes recomputation repeat the last reduction of a layer)
    (
        "tp2-sp-pp2-recompute",
        4,
        [
            "parallel.tp_size=2",
            "parallel.pp_size=2",
            "parallel.sequence_parallel=true",
            "train.recompute=full",
            "model.tie_embeddings=false",
        ],
    ),
    (
        "tp2-pp2-fp16-dropout-recompute",
        4,
        ["parallel.tp_size=2", "parallel.pp_size=2", "train.precision=fp16", "optim.initial_loss_scale=128"]
        + ["train.recompute=full", "model.hidden_dropout=0.1", "parallel.scatter_gather=false"],
    ),
    (
        "tp2-cp2-selective-bf16",
        4,
        ["parallel.tp_size=2", "parallel.cp_size=2", "train.recompute=selective", "train.precision=bf16"],
    ),
    # sharded data parallelism (FSDP2): the gathers and reduce-scatters it issues through its custom collectives
    ("fsdp-dp4-two-microbatches", 4, ["parallel.fsdp=true", "train.global_batch_size=16"]),
    (
        "fsdp-dp3-uneven-shards-recompute",
        3,
        ["parallel.fsdp=true", "train.global_batch_size=6", "train.recompute=full"],
    ),
    (
        "fsdp-dp2-tp2-sp-no-reshard-bf16",
        4,
        ["parallel.fsdp=true", "parallel.fsdp_reshard_after_forward=false", "parallel.tp_size=2"]
        + ["parallel.sequence_parallel=true", "train.precision=bf16"],
    ),
    ("fsdp-dp2-cp2", 4, ["parallel.fsdp=true", "parallel.cp_size=2"]),
    (
        "hsdp-2x2-tp2-sp-fp16",
        8,
        ["parallel.fsdp=true", "parallel.fsdp_replicate=2", "parallel.tp_size=2", "parallel.sequence_parallel=true"]
        + ["train.precision=fp16", "optim.initial_loss_scale=128"],
    ),
]


def _record_rank(rank: int, world_size: int, argv: list[str], out_dir: str) -> None:
    config = load_config(pretrain_gpt.DEFAULT_CONFIG, argv)
    env = init_distributed(False, 1, announce_threads=False)
    run = build_run(config, env, layout_from_config(config, world_size))
    recorder = run.state.comm.recorder = CommRecorder(keep_all=True)
    train(run)
    state = run.state
    issued = [r.__dict__ for r in recorder.records("train", RECORDED_ITERATION)]
    assert issued and {r.region for r in recorder.records(iteration=RECORDED_ITERATION)} >= {"boundary", "train"}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump({"pp_rank": state.pp_rank, "dp_cp_rank": state.dp_cp_rank, "issued": issued}, handle)


def _key(kind, group, group_size, nbytes):
    return kind, group, group_size, nbytes


# the four and FSDP's first case in the fast tier; the other combinations (3-5 CPU s each) in the full tier
FAST_LAYOUTS = {"tp2-pp2-dp2-distopt", "interleaved-pp2-vp2", "zb-v-pp2-tied", "cp2-dp2", "fsdp-dp4-two-microbatches"}


@pytest.mark.parametrize(
    "name, world_size, overrides", [tiers.layout_case(layout[0], *layout, fast=FAST_LAYOUTS) for layout in LAYOUTS]
)
def test_the_planners_list_is_what_the_run_issued(tiny_corpus, tmp_path, name, world_size, overrides):
    extra = ["train.train_iters=2", "train.eval_iters=0", "checkpoint.save=false", *overrides]
    argv = tiny_train_args(tiny_corpus, str(tmp_path / "run"), *extra)
    run_ranks(world_size, _record_rank, argv, str(tmp_path), timeout=240.0)
    # the tokenizer fills in model.vocab_size at run time: take the run's resolved config
    config = load_config(str(tmp_path / "run" / "config.yaml"))
    planned = LayoutCollectives(config, layout_from_config(config, world_size))
    for rank in range(world_size):
        with open(tmp_path / f"rank{rank}.json", encoding="utf-8") as handle:
            record = json.load(handle)
        issued = Counter(_key(r["kind"], r["group"], r["group_size"], r["nbytes"]) for r in record["issued"])
        listed = Counter(
            _key(c.kind, c.group, c.group_size, c.nbytes) for c in planned.rank(record["pp_rank"], record["dp_cp_rank"])
        )
        assert listed == issued, (
            f"{name} rank {rank}: planned but not issued {dict(listed - issued)}; "
            f"issued but not planned {dict(issued - listed)}"
        )
