"""The planner for Mixture-of-Experts models (planner/experts.py on model/shape.py's count): FLOPs from active
parameters against a count written out here, expert state per rank against ep, the all-to-all's bytes and where they travel, the expert-dp
gradient reduction, the search's ep rules, and tools/plan.py on configs/moe/mixtral_8x7b.yaml.
"""

import dataclasses
import os
import subprocess
import sys

import pytest

from config.schema import load_config
from model.rank_spec import Recompute
from model.shape import active_params, iteration_flops, layer_forward_flops, moe_layer_ids
from parallel.layout import LayoutError, build_layout
from planner.cluster import load_cluster
from planner.collectives import LayoutCollectives
from planner.costs import Hardware, collective_seconds_of
from planner.experts import ExpertLayout, expert_grid
from planner.predict import predict
from planner.search import candidate_eps, search
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.tier("fast")

MIXTRAL = os.path.join(REPO_ROOT, "configs", "moe", "mixtral_8x7b.yaml")
OLMOE = os.path.join(REPO_ROOT, "configs", "moe", "olmoe_1b_7b.yaml")
H100 = os.path.join(REPO_ROOT, "configs", "clusters", "dgx_h100.yaml")


def tiny_moe(*overrides: str):
    """A small MoE model (4 layers, 8 experts top-2 of width 96, a shared expert of 64, bf16) for the lists."""
    return load_config(
        os.path.join(REPO_ROOT, "configs", "llama_tiny.yaml"),
        [
            "model.num_layers=4",
            "model.num_experts=8",
            "model.moe_router_topk=2",
            "model.moe_ffn_hidden_size=96",
            "model.moe_shared_expert_ffn_hidden_size=64",
            "model.vocab_size=256",
            "train.precision=bf16",
            *overrides,
        ],
    )


def test_mixtral_layer_flops_equal_a_count_by_hand():
    config = load_config(MIXTRAL)
    model = config.model
    h, kv, f, s, tokens = 4096, 8 * 128, 14336, 4096, 1000.0
    attention_gemms = h * (h + 2 * kv) + h * h  # q, k, v; proj
    active_mlp = h * 8 + 2 * (h * 2 * f + f * h)  # the router; top-2 experts of fc1 [h, 2f] and fc2 [f, h]
    by_hand = 2 * tokens * (attention_gemms + active_mlp) + 2 * (2 * tokens * s * h)  # q k^T and scores v
    assert moe_layer_ids(model) == list(range(32))
    assert layer_forward_flops(model, tokens, s, 0) == pytest.approx(by_hand, rel=1e-12)
    # the iteration: 3 x forward of 32 layers and the output layer, per sequence of 4096 tokens, global batch 256
    flops = iteration_flops(model, 32000, 256, Recompute("none"), 32)
    forward = 256 * (32 * layer_forward_flops(model, 4096, s, 0) + 2 * 4096 * h * 32000)
    assert flops.model == pytest.approx(3 * forward, rel=1e-12)
    assert flops.with_recompute == flops.model
    # active parameters per token: Mixtral's published 12.9B
    active = 32 * (attention_gemms + active_mlp + 2 * h) + 2 * 32000 * h + h
    assert active == pytest.approx(12.9e9, rel=0.01)
    assert active_params(model) == active


def test_a_dense_model_counts_no_experts_and_shared_experts_count_once():
    dense = load_config(os.path.join(REPO_ROOT, "configs", "llama_tiny.yaml"))
    assert moe_layer_ids(dense.model) == []
    moe = tiny_moe().model
    h, f, shared = 128, 96, 64
    qkv_proj = h * (h + 2 * 64) + h * h  # 8 heads of 16, 4 query groups: k and v of 64 each
    mlp = h * 8 + 2 * (h * 2 * f + f * h) + (h * 2 * shared + shared * h)
    assert layer_forward_flops(moe, 10.0, moe.seq_length, 1) == pytest.approx(
        2 * 10 * (qkv_proj + mlp) + 2 * 2 * 10 * 128 * h
    )


def test_expert_memory_per_rank_shrinks_with_ep_and_the_distributed_optimizer_keeps_its_total():
    """64 H100 as Megatron-core ran Mixtral (tp 1, pp 4, vp 8, dp 16): the experts' weights and grads per rank
    divide by ep; the distributed optimizer shards their state over expert-dp = 16 / ep, so its bytes per rank
    stay; without it the state divides by ep too."""
    config = load_config(MIXTRAL)
    cluster = load_cluster(H100)
    one_expert = 3 * 4096 * 14336
    per_rank_layers = 8
    results = {ep: predict(config, cluster, 64, ep_size=ep) for ep in (1, 2, 4, 8)}
    for ep, p in results.items():
        expert_weights = per_rank_layers * (8 // ep) * one_expert
        less = results[1].memory.params - p.memory.params
        assert less == per_rank_layers * 8 * one_expert - expert_weights
        assert results[1].memory.weights - p.memory.weights == pytest.approx(2 * less)
        assert results[1].memory.grads - p.memory.grads == pytest.approx(4 * less)
        assert p.memory.optimizer == pytest.approx(results[1].memory.optimizer)
    assert results[1].memory_gib > 80 and results[8].memory_gib < 80  # ep 8 is what makes it fit
    plain = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, distributed_optimizer=False))
    one, eight = (predict(plain, cluster, 64, ep_size=ep).memory for ep in (1, 8))
    assert one.optimizer - eight.optimizer == pytest.approx(12 * per_rank_layers * 7 * one_expert)


def test_all_to_all_bytes_per_layer_forward_and_backward():
    """ep 2 on 2 ranks, 4 MoE layers, micro-batch 4 x 128 tokens, top-2, bf16: per layer forward the counts
    (8 int64), the tokens [P, h], their fp32 weights [P] and the outputs [P, h]; backward the two gradients of
    [P, h] and the weights' gradient; full recomputation repeats the forward ones."""
    config = tiny_moe("train.recompute=full")
    layout = build_layout(config.model, config.parallel, config.train, 2)
    comms = LayoutCollectives(config, layout, ep_size=2)
    rows = 128 * 4 * 2  # P
    forward_bytes = sorted([8 * 8, rows * 128 * 2, rows * 4, rows * 128 * 2])
    forward = [c for c in comms.action(0, op=_op("FORWARD")).all if c.kind == "all_to_all"]
    assert {(c.group, c.group_size) for c in forward} == {("ep", 2)}
    assert sorted(c.nbytes for c in forward) == sorted(forward_bytes * 4)
    backward = [c.nbytes for c in comms.action(0, op=_op("BACKWARD")).all if c.kind == "all_to_all"]
    assert sorted(backward) == sorted((forward_bytes + [rows * 128 * 2, rows * 128 * 2, rows * 4]) * 4)
    # sequence parallelism at tp 2: each tp rank routes its 1/2 of the tokens, and an MoE layer has only
    # attention's all-gather and reduce-scatter
    sp = tiny_moe("parallel.tp_size=2", "parallel.sequence_parallel=true")
    sp_layout = build_layout(sp.model, sp.parallel, sp.train, 4)
    sp_comms = LayoutCollectives(sp, sp_layout, ep_size=2)
    tokens = [c.nbytes for c in sp_comms.action(0, _op("FORWARD")).all if c.kind == "all_to_all"]
    assert max(tokens) == rows // 2 * 128 * 2
    tp = [c.kind for c in sp_comms.layer(forward=True).tp]
    assert tp == ["all_gather", "reduce_scatter"] * 2  # `layer` is the dense one
    assert [c.kind for c in sp_comms._tp_layer(0)] == ["all_gather", "reduce_scatter"]
    # with the load-balancing loss each MoE layer sums its int64 expert counts over tp (sequence parallel)
    aux = tiny_moe("parallel.tp_size=2", "parallel.sequence_parallel=true", "model.moe_aux_loss_coeff=0.01")
    aux_comms = LayoutCollectives(aux, build_layout(aux.model, aux.parallel, aux.train, 4), ep_size=2)
    counts = [c for c in aux_comms.action(0, _op("FORWARD")).tp if c.kind == "all_reduce" and c.nbytes == 8 * 8]
    assert len(counts) == 4 and {c.group for c in counts} == {"tp"}


def _op(name: str):
    from parallel.pipeline.schedules import Op

    return Op[name]


def test_all_to_all_inside_a_node_is_cheaper_than_across_nodes():
    """The ep group's placement decides the link: ep 8 at tp 1 is one node's 8 ranks (NVLink), at tp 8 its
    members are 8 ranks apart, one per node (the network cards)."""
    cluster = load_cluster(H100)
    config = load_config(MIXTRAL)
    seconds = {}
    for tp in (1, 8):
        candidate = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, tp_size=tp))
        layout = build_layout(candidate.model, candidate.parallel, candidate.train, 64 if tp == 1 else 512)
        grid = expert_grid(layout, 8)
        hw = Hardware(cluster, False, grid, grid)
        assert hw.per_node("ep") == (8 if tp == 1 else 1)
        comms = LayoutCollectives(candidate, layout, ep_size=8)
        tokens = max((c for c in comms.action(0, _op("FORWARD")).ep), key=lambda c: c.nbytes)
        seconds[tp] = collective_seconds_of(hw, tokens)
    assert seconds[8] > 3 * seconds[1]


def test_expert_gradients_reduce_over_expert_dp_beside_the_dense_reduction():
    """dp 4 with ep 2: expert buckets go over the expert-dp group of 2, everything else over dp 4; the bytes of
    each are its params' fp32 grads (plain all-reduce: no padding)."""
    config = tiny_moe()
    layout = build_layout(config.model, config.parallel, config.train, 4)
    comms = LayoutCollectives(config, layout, ep_size=2)
    reductions = comms.grad_reduction(0)
    expert = sum(c.nbytes for c in reductions if c.group == "expert_dp")
    dense = sum(c.nbytes for c in reductions if c.group == "dp")
    assert {(c.group, c.group_size) for c in reductions} == {("expert_dp", 2), ("dp", 4)}
    one_expert = 128 * 2 * 96 + 96 * 128
    assert expert == 4 * 4 * (8 // 2) * one_expert  # 4 layers x 4 local experts, fp32
    everything = LayoutCollectives(config, layout, ep_size=1).grad_reduction(0)
    assert {c.group for c in everything} == {"dp"}  # ep 1: the experts are ordinary replicated weights
    assert sum(c.nbytes for c in everything) == dense + 4 * 4 * 8 * one_expert
    # ep = dp x cp: no other rank holds a rank's experts, nothing to reduce for them
    alone = LayoutCollectives(config, layout, ep_size=4).grad_reduction(0)
    assert {c.group for c in alone} == {"dp"}


def test_expert_layout_refuses_what_megatron_refuses():
    config = tiny_moe()
    layout = build_layout(config.model, config.parallel, config.train, 4)
    with pytest.raises(LayoutError, match=r"parallel.ep_size=3 does not divide dp x cp = 4"):
        ExpertLayout.of(config.model, layout, 3)
    six = tiny_moe("model.num_experts=6")
    with pytest.raises(LayoutError, match=r"model.num_experts=6 is not divisible by parallel.ep_size=4"):
        ExpertLayout.of(six.model, build_layout(six.model, six.parallel, six.train, 4), 4)
    dense = load_config(os.path.join(REPO_ROOT, "configs", "llama_tiny.yaml"))
    dense_layout = build_layout(dense.model, dense.parallel, dense.train, 2)
    with pytest.raises(LayoutError, match=r"parallel.ep_size=2 needs an MoE model"):
        ExpertLayout.of(dense.model, dense_layout, 2)


def test_search_tries_only_the_eps_that_divide_dp_cp_and_the_experts():
    config = tiny_moe("model.num_experts=6", "train.global_batch_size=24", "train.micro_batch_size=1")
    layout = build_layout(config.model, config.parallel, config.train, 6)
    assert candidate_eps(config, layout) == [1, 2, 3, 6]
    assert candidate_eps(config, build_layout(config.model, config.parallel, config.train, 4)) == [1, 2]
    cluster = load_cluster(os.path.join(REPO_ROOT, "configs", "clusters", "cpu_2core.yaml"))
    result = search(config, cluster, 4, simulate_top=1000)  # every fitting candidate predicted in full
    assert result.ranked
    for p in result.ranked:
        dp_cp = p.layout.dp_size * p.layout.cp_size
        assert dp_cp % p.ep_size == 0 and 6 % p.ep_size == 0
    # ep is searched, not only kept: dp 4 tries ep 2, dp 2 tries ep 2, dp 1 only ep 1 (and no FSDP layout)
    assert {p.ep_size for p in result.ranked} == {1, 2}
    assert {p.layout.dp_size for p in result.ranked if p.ep_size == 2} == {2, 4}
    assert not any(p.layout.fsdp for p in result.ranked)
    sharded = tiny_moe("parallel.fsdp=true", "parallel.distributed_optimizer=false")
    with pytest.raises(LayoutError, match=r"parallel.fsdp=true with model.num_experts=8: the planner does not model"):
        predict(sharded, cluster, 2)


def test_olmoe_config_counts_its_published_sizes():
    model = load_config(OLMOE).model
    h, f = 2048, 1024
    attention = 4 * h * h
    per_layer_active = attention + h * 64 + 8 * 3 * h * f + 2 * h
    active = 16 * per_layer_active + 2 * 50304 * h + h
    assert active == pytest.approx(1.3e9, rel=0.03)  # OLMoE-1B-7B: 1.3B active (q/k norm left out)
    assert active_params(model) == active
    assert layer_forward_flops(model, 1.0, model.seq_length, 0) == pytest.approx(
        2 * (attention + h * 64 + 8 * 3 * h * f) + 4 * 4096 * h
    )


def plan(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, os.path.join(REPO_ROOT, "tools", "plan.py"), "--cluster", H100, *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def test_plan_py_prints_a_prediction_for_mixtral():
    out = plan("--config", MIXTRAL, "--gpus", "64")
    assert out.returncode == 0, out.stderr
    assert "predicted:" in out.stdout and "TFLOP/s per GPU" in out.stdout
    assert "ep_comm" in out.stdout


def test_plan_py_takes_ep_from_the_config():
    out = plan("--config", MIXTRAL, "--gpus", "64", "parallel.ep_size=8")
    assert out.returncode == 0, out.stderr
    assert "predicted:" in out.stdout and "ep 8" in out.stdout
