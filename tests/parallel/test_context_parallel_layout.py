"""Context parallelism as a layout dimension: the layout rules (one line each), the rank order (tp, cp, dp,
pp), the dp x cp replica group, and what the planner and tools/model_stats.py say about cp."""

from __future__ import annotations

import os
import sys

import pytest

from config.schema import load_config
from parallel.layout import LayoutError, layout_from_config
from parallel.rank_grid import RankGrid
from parallel.state import ParallelState
from planner.activations import layer_activation_bytes, shape_from_config
from planner.cluster import load_cluster
from planner.collectives import ActionCollectives, LayoutCollectives
from planner.costs import Hardware, action_comm_seconds
from tests.cli_runner import run_cli
from tests.conftest import REPO_ROOT, assert_entry_points_refuse

pytestmark = pytest.mark.tier("fast")


def layout(world_size: int, *overrides: str):
    return layout_from_config(load_config(None, ["model.attention_dropout=0.0", *overrides]), world_size)


def test_cp_is_a_fourth_dimension():
    lay = layout(16, "parallel.cp_size=2", "parallel.tp_size=2", "parallel.pp_size=2", "train.global_batch_size=32")
    assert (lay.tp_size, lay.cp_size, lay.dp_size, lay.pp_size, lay.world_size) == (2, 2, 2, 2, 16)
    assert "cp 2" in lay.describe()


INVALID = [
    (
        2,
        ("parallel.cp_size=2", "model.seq_length=130"),
        "model.seq_length=130 is not divisible by 2 * parallel.cp_size=4",
    ),
    (
        2,
        ("parallel.cp_size=2", "parallel.cp_attention_backend=sdpa"),
        "parallel.cp_size=2 needs an attention backend that returns the log-sum-exp; "
        "parallel.cp_attention_backend=sdpa does not: use torch",
    ),
    (2, ("parallel.cp_size=2", "model.attention_dropout=0.1"), "does not support model.attention_dropout=0.1"),
    (
        6,
        ("parallel.cp_size=4",),
        "world size 6 is not divisible by parallel.tp_size * parallel.cp_size * parallel.pp_size = 1 * 4 * 1 = 4",
    ),
    (
        8,
        ("parallel.cp_size=2", "parallel.tp_size=4", "parallel.sequence_parallel=true", "model.seq_length=12"),
        "model.seq_length / parallel.cp_size = 12 / 2)=6 is not divisible by parallel.tp_size",
    ),
    (1, ("parallel.cp_size=0",), "parallel.cp_size=0 must be >= 1"),
]


@pytest.mark.parametrize(
    "world_size,overrides,message", INVALID, ids=["seq", "backend", "dropout", "world", "sp", "positive"]
)
def test_bad_layouts_are_refused_with_one_line(world_size, overrides, message):
    with pytest.raises(LayoutError) as refused:
        layout(world_size, *overrides)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("overrides", [INVALID[0][1], INVALID[1][1]], ids=["seq", "backend"])
def test_trainer_and_model_stats_refuse_before_any_work(overrides, tmp_path):
    with pytest.raises(LayoutError) as refused:  # the trainer's default config
        layout_from_config(load_config(os.path.join(REPO_ROOT, "configs", "gpt_tiny.yaml"), list(overrides)), 2)
    assert_entry_points_refuse(list(overrides), 2, str(refused.value), f"{tmp_path}/run")


def test_rank_order_is_tp_cp_dp_pp():
    grid = RankGrid.megatron(tp=2, cp=2, dp=2, pp=2)
    assert grid.group(0, "tp") == [0, 1]
    assert grid.group(0, "cp") == [0, 2]
    assert grid.group(0, "dp") == [0, 4]
    assert grid.group(0, "pp") == [0, 8]
    assert grid.group(5, "cp", "dp") == [1, 3, 5, 7]
    # without cp the order is Megatron's tp, dp, pp as before
    assert RankGrid.megatron(tp=2, dp=2, pp=2).group(0, "dp") == [0, 2]


def test_replicas_of_a_parameter_are_dp_x_cp():
    for rank in range(16):
        state = ParallelState(world_size=16, rank=rank, tp_size=2, pp_size=2, dp_size=2, cp_size=2)
        members = state.grid.group(rank, "cp", "dp")
        assert state.dp_cp_size == 4 and members.index(rank) == state.dp_cp_rank
    single = ParallelState.single()
    assert single.dp_cp_size == 1 and single.dp_cp_group is single.dp_group


def test_planner_activations_fall_with_cp_and_ring_bytes():
    def config(cp: int):
        return load_config(None, ["model.seq_length=8192", "model.attention_dropout=0.0", f"parallel.cp_size={cp}"])

    per_layer = [
        layer_activation_bytes(
            shape_from_config(c, layout_from_config(c, c.parallel.cp_size), attention="flash"), "none"
        )
        for c in (config(1), config(4))
    ]
    assert per_layer[1] == pytest.approx(per_layer[0] / 4)
    # cp4: a kv block is 2 x 2048 tokens x b 4 x 4 groups x 32 dims x 4 bytes; 3 sends forward, 7 backward
    block = 2 * 2048 * 4 * 4 * 32 * 4

    def sent(c, forward: bool) -> int:
        ring = LayoutCollectives(c, layout_from_config(c, c.parallel.cp_size)).ring(1, forward)
        return sum(x.nbytes for x in ring if x.kind == "send")

    assert (sent(config(4), True), sent(config(4), False)) == (3 * block, 7 * block)
    assert (sent(config(1), True), sent(config(1), False)) == (0, 0)
    # a transfer hidden behind its block's attention costs nothing; beyond it, the excess per send
    cluster = load_cluster(os.path.join(REPO_ROOT, "configs", "clusters", "dgx_a100_80gb.yaml"))
    hw = Hardware(cluster, fp32=True, grid=RankGrid.megatron(cp=4))
    ring = LayoutCollectives(config(4), layout_from_config(config(4), 4)).ring(1, True)  # 3 sends and receives
    link = hw.link_seconds(block, inter_node=False)
    assert action_comm_seconds(hw, ActionCollectives(ring_forward=ring), 2 * link) == 0.0
    assert action_comm_seconds(hw, ActionCollectives(ring_forward=ring), link / 2) == pytest.approx(1.5 * link)


def test_model_stats_reports_cp():
    result = run_cli(
        [sys.executable, "tools/model_stats.py", "--config", "configs/gpt_tiny.yaml", "model.vocab_size=257"]
        + ["parallel.cp_size=2", "model.attention_dropout=0.0"],
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "tp 1 x cp 2 x pp 1" in result.stdout and "ring attention (cp 2, 64 tokens per rank)" in result.stdout
