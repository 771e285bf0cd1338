"""Each cost term of planner/costs.py on its own, and the cluster spec loader."""

import os
import subprocess
import sys

import pytest

from config.schema import load_config
from parallel.layout import layout_from_config
from parallel.pipeline.p2p import Message, Step
from parallel.pipeline.schedules import Op
from parallel.rank_grid import RankGrid
from planner.activations import ActivationShape
from planner.cluster import ClusterError, cluster_from_dict, load_cluster
from planner.collectives import LayoutCollectives
from planner.costs import (
    Hardware,
    action_comm_seconds,
    core_attention_seconds,
    layer_times,
    optimizer_seconds,
    step_seconds,
)
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.tier("fast")

CLUSTERS = os.path.join(REPO_ROOT, "configs", "clusters")
TP8 = RankGrid.megatron(tp=8, dp=4)  # the layout of shape(): one tp group per node of 8


def a100(**efficiency):
    return load_cluster(os.path.join(CLUSTERS, "dgx_a100_80gb.yaml")).with_efficiency(**efficiency)


def shape(tp=8, sp=False, b=1, cp=1):
    return ActivationShape(
        seq_length=2048,
        local_seq=2048 // cp,
        micro_batch=b,
        hidden=12288,
        heads=96,
        query_groups=96,
        ffn=49152,
        swiglu=False,
        tp_size=tp,
        sequence_parallel=sp,
        value_bytes=2,
        cp_size=cp,
    )


def test_cluster_files_load_and_say_what_the_paper_says():
    spec = load_cluster(os.path.join(CLUSTERS, "dgx_a100_80gb.yaml"))
    assert (spec.peak_tflops, spec.nvlink_gbs, spec.gpus_per_node, spec.memory_gib) == (312, 600, 8, 80)
    assert spec.network_gbs_per_gpu == 25.0  # 8 x 200 Gb/s per node of 8 GPUs
    for name in ("dgx_h100.yaml", "dgx_h200.yaml"):
        other = load_cluster(os.path.join(CLUSTERS, name))
        assert other.peak_tflops > spec.peak_tflops and other.network_gbs_per_gpu == 50.0


def test_cluster_errors_name_the_key(tmp_path):
    raw = {
        "gpu": {"peak_tflops_bf16": 1, "peak_tflops_fp32": 1, "memory_gib": 1, "hbm_gbs": 1},
        "node": {"gpus": 8, "nvlink_gbs": 1},
        "network": {"links_per_node": 1, "link_gbps": 1},
    }
    assert cluster_from_dict(raw).gpus_per_node == 8
    with pytest.raises(ClusterError, match="unknown key gpu.peak_tflop; did you mean gpu.peak_tflops_"):
        cluster_from_dict({**raw, "gpu": {**raw["gpu"], "peak_tflop": 3}})
    with pytest.raises(ClusterError, match="missing key network.link_gbps"):
        cluster_from_dict({**raw, "network": {"links_per_node": 1}})
    with pytest.raises(ClusterError, match=r"efficiency.hbm=1.5 must be in \(0, 1\]"):
        cluster_from_dict({**raw, "efficiency": {"hbm": 1.5}})
    path = tmp_path / "bad.yaml"
    path.write_text("gpu: [1\n")
    with pytest.raises(ClusterError, match="is not valid YAML"):
        load_cluster(str(path))


def test_gemm_efficiency_curve():
    hw = Hardware(a100(gemm_max=0.8, gemm_half_flops=1e10, gemm_half_rows=0.0), fp32=False, grid=TP8)
    at_half = hw.gemm_seconds(1e10, 2048)
    assert 1e10 / at_half / 312e12 == pytest.approx(0.4)  # half of gemm_max at F = gemm_half_flops
    assert 1e14 / hw.gemm_seconds(1e14, 2048) / 312e12 == pytest.approx(0.8, rel=1e-3)  # large GEMMs: gemm_max
    rows = Hardware(a100(gemm_max=0.8, gemm_half_flops=0.0, gemm_half_rows=256.0), fp32=False, grid=TP8)
    assert 1e12 / rows.gemm_seconds(1e12, 256) / 312e12 == pytest.approx(0.4)  # half at gemm_half_rows rows
    assert rows.gemm_seconds(2e12, 4096) < 2 * rows.gemm_seconds(1e12, 2048)  # a bigger micro-batch runs faster


def test_memory_and_link_terms():
    hw = Hardware(
        a100(hbm=0.5, nvlink=1.0, network=1.0, latency_us=0.0, nvlink_latency_us=0.0, collective_base_us=0.0),
        fp32=False,
        grid=TP8,
    )
    assert hw.memory_seconds(2039e9) == pytest.approx(2.0)
    assert hw.link_seconds(25e9, inter_node=True) == pytest.approx(1.0)  # one IB card per GPU
    assert hw.link_seconds(300e9, inter_node=False) == pytest.approx(1.0)  # 600 GB/s both ways
    # ring all-reduce inside a node: 2 (g-1)/g of the buffer each way; reduce-scatter half of it
    assert hw.collective_seconds("all_reduce", 300e9, 8, 8) == pytest.approx(2 * 7 / 8)
    assert hw.collective_seconds("reduce_scatter", 300e9, 8, 8) == pytest.approx(7 / 8)
    assert hw.collective_seconds("all_reduce", 300e9, 1, 1) == 0.0
    # tp 16 spans two nodes: 8 rings, one per network card, each carrying 2 * 15/16 / 8 of the buffer
    across = hw.collective_seconds("all_reduce", 300e9, 16, 8)
    assert across == pytest.approx(2 * 15 / 16 * 300e9 / 8 / 25e9) and across > 1.5 * (2 * 7 / 8)


def test_group_placement():
    def per_node(dim, **sizes):
        return RankGrid.megatron(**sizes).per_node(8, dim)

    assert per_node("tp", tp=8, dp=2) == 8 and per_node("tp", tp=16) == 8 and per_node("tp", tp=2, dp=8) == 2
    assert per_node("dp", tp=8, dp=32) == 1 and per_node("dp", tp=2, dp=32) == 4 and per_node("dp", dp=2) == 2
    assert not RankGrid.megatron(tp=2, pp=4).crosses_nodes("pp", 8)
    assert RankGrid.megatron(tp=8, pp=2).crosses_nodes("pp", 8)
    # a dp group of 3 from rank 6 sits 2 on one node, 1 on the next: 2 share a node
    assert per_node("dp", dp=3, pp=3) == 2


def test_rank_grid_is_megatrons_order():
    grid = RankGrid.megatron(tp=2, dp=2, pp=2)
    assert [grid.coord(5, d) for d in ("tp", "dp", "pp")] == [1, 0, 1] and grid.rank_of(tp=1, pp=1) == 5
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.group(6, "tp", "pp") == [2, 3, 6, 7]  # the model-parallel group of dp rank 1
    with pytest.raises(ValueError, match="'ep'"):
        RankGrid.megatron(ep=2)  # cp is a dimension now (tests/parallel/test_context_parallel_layout.py)


def paper_145b(*overrides: str, world: int = 32):
    """The 145.6B model (h 12288, s 2048, bf16) at micro-batch 1 as LayoutCollectives sees it."""
    config = load_config(
        os.path.join(REPO_ROOT, "configs", "paper", "gpt_145.6b.yaml"),
        ["train.micro_batch_size=1", "train.global_batch_size=64", "parallel.pp_size=1", *overrides],
    )
    return config, LayoutCollectives(config, layout_from_config(config, world))


def test_scatter_gather_cuts_inter_node_bytes_by_tp():
    hw = Hardware(
        a100(latency_us=0.0, nvlink_latency_us=0.0, collective_base_us=0.0),
        fp32=False,
        grid=RankGrid.megatron(tp=8, pp=2),
    )
    receive = Step((("recv", 0, Message(Op.FORWARD, 0, 1)),), None)  # a batch receiving one activation
    nbytes = 2048 * 12288 * 2
    plain = step_seconds(
        hw, paper_145b("parallel.pp_size=2", "parallel.scatter_gather=false", world=16)[1].step(receive)
    )
    scattered = step_seconds(hw, paper_145b("parallel.pp_size=2", world=16)[1].step(receive))
    assert plain == pytest.approx(nbytes / (25e9 * hw.cluster.efficiency.network))
    gather = hw.collective_seconds("all_gather", nbytes, 8, 8)
    assert scattered == pytest.approx(plain / 8 + gather)
    sequence_parallel = paper_145b("parallel.pp_size=2", "parallel.sequence_parallel=true", world=16)[1]
    assert step_seconds(hw, sequence_parallel.step(receive)) == pytest.approx(plain / 8)


def test_recompute_and_tp_terms_of_a_layer():
    config, none = paper_145b()
    hw = Hardware(a100(), fp32=False, grid=TP8)
    times = {r: layer_times(shape(), config.model, hw, r) for r in ("none", "selective", "full")}
    assert times["none"].backward == pytest.approx(2 * times["none"].forward) and times["none"].recompute == 0
    assert times["full"].backward == pytest.approx(3 * times["none"].forward)
    assert times["full"].recompute == pytest.approx(times["none"].forward)
    assert times["selective"].recompute == pytest.approx(core_attention_seconds(shape(), config.model, hw))
    one_way = 2 * hw.collective_seconds("all_reduce", 2048 * 12288 * 2, 8, 8)  # two all-reduces per layer
    assert action_comm_seconds(hw, none.layer(forward=True), 0.0) == pytest.approx(one_way)
    # a middle layer's backward: its own two all-reduces, and under full recomputation the recomputed
    # forward's two (hidden dropout 0.1 keeps the second one in the recomputation)
    full = paper_145b("train.recompute=full", "parallel.pp_size=4", "parallel.vp_size=1", world=32)[1]
    middle = full.action(1, Op.BACKWARD).tp  # a stage without the embedding or the head
    layers = config.model.num_layers // 4
    assert len(middle) == layers * 4 and all(c.kind == "all_reduce" and c.group == "tp" for c in middle)
    # bigger micro-batches run bigger GEMMs: time per sample falls
    assert layer_times(shape(b=4), config.model, hw, "none").forward < 4 * times["none"].forward


def test_context_parallel_layer_runs_its_share_and_its_ring_shows_only_when_slow():
    model = load_config(os.path.join(REPO_ROOT, "configs", "paper", "gpt_145.6b.yaml")).model
    one = layer_times(shape(), model, Hardware(a100(), fp32=False, grid=TP8), "none")
    within = Hardware(a100(), fp32=False, grid=RankGrid.megatron(tp=4, cp=2, dp=4))  # cp pairs on one node
    two = layer_times(shape(tp=4, cp=2), model, within, "none")
    # at one tp size a cp rank attends half the queries to every key: about half the attention time
    assert core_attention_seconds(shape(cp=2), model, within) < 0.6 * core_attention_seconds(shape(), model, within)
    # half the tokens on twice the tp share: about the same work per rank
    assert 0.8 < two.forward / one.forward < 1.3
    cp_layer = paper_145b("parallel.tp_size=4", "parallel.cp_size=2", "model.attention_dropout=0.0")[1].layer(True)
    # within a node the ring hides behind the block attention: the tp all-reduces are all that shows
    assert action_comm_seconds(within, cp_layer, two.core / 2) == pytest.approx(
        2 * within.collective_seconds("all_reduce", 1024 * 12288 * 2, 4, 4)
    )
    grid = RankGrid.megatron(tp=8, cp=2)  # every cp pair spans two nodes
    slow = Hardware(a100(network=0.001), fp32=False, grid=grid)  # a very slow network: the ring cannot hide
    cp8 = paper_145b("parallel.cp_size=2", "model.attention_dropout=0.0", world=64)[1].layer(True)
    core = layer_times(shape(cp=2), model, slow, "none").core
    assert action_comm_seconds(slow, cp8, core / 2) > 2 * slow.collective_seconds("all_reduce", 1024 * 12288 * 2, 8, 8)


def test_optimizer_step_shrinks_with_the_distributed_optimizer():
    hw = Hardware(a100(), fp32=False, grid=TP8)
    assert optimizer_seconds(10**9, 8, True, hw) < optimizer_seconds(10**9, 8, False, hw)
    assert optimizer_seconds(10**9, 1, False, hw) == pytest.approx(34e9 / (2039e9 * hw.cluster.efficiency.hbm))


def test_planner_imports_no_training_code():
    code = "import sys, planner.calibrate, planner.published, planner.search, planner.plots; "
    code += "print([m for m in sys.modules if m == 'training' or m.startswith('training.')])"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_ring_latency_counts_steps_inside_and_across_nodes_as_nccl_does():
    # NCCL's tuning model: a base latency per call, and an all-reduce over n ranks on k nodes takes 2 (n - 1)
    # ring steps, 2 (k - 1) of them across nodes (network latency), the rest over NVLink
    hw = Hardware(a100(latency_us=10.0, nvlink_latency_us=3.0, collective_base_us=8.0), fp32=False, grid=TP8)
    tiny = 1.0  # bytes: the latency is all that is left
    assert hw.collective_seconds("all_reduce", tiny, 8, 8) == pytest.approx((8 + 14 * 3) * 1e-6, rel=1e-3)
    assert hw.collective_seconds("all_reduce", tiny, 32, 8) == pytest.approx((8 + 6 * 10 + 56 * 3) * 1e-6, rel=1e-3)
    assert hw.collective_seconds("all_gather", tiny, 32, 8) == pytest.approx((8 + 3 * 10 + 28 * 3) * 1e-6, rel=1e-3)
    assert hw.link_seconds(tiny, inter_node=False) == pytest.approx((8 + 3) * 1e-6, rel=1e-3)
    assert hw.link_seconds(tiny, inter_node=True) == pytest.approx((8 + 10) * 1e-6, rel=1e-3)
