"""Parameter counts against the meta-device model, Korthikanti's activation formula, the memory model against
the optimizer-state formulas and the trainer's measured CPU memory (docs/performance.md)."""

import os

import pytest

from config.schema import load_config
from model.param_info import param_info
from model.shape import chunk_parameters, rank_params, total_params
from parallel.layout import Layout, layout_from_config
from parallel.pipeline.schedules import build_schedule
from parallel.run_shape import RunShape
from planner.activations import ActivationShape, head_activation_bytes, layer_activation_bytes, shape_from_config
from planner.memory import layout_memory, max_in_flight, state_bytes_per_param
from tests.conftest import REPO_ROOT
from tools.model_stats import count, meta_chunks, total_parameters

pytestmark = pytest.mark.tier("fast")

MIB = 2.0**20


@pytest.mark.parametrize(
    "config_name, overrides",
    [
        ("gpt_tiny.yaml", ["parallel.tp_size=2", "parallel.pp_size=2", "parallel.vp_size=2"]),
        ("gpt_tiny.yaml", ["parallel.tp_size=4", "parallel.pp_size=1", "model.tie_embeddings=false"]),
        ("llama_tiny.yaml", ["parallel.tp_size=2", "parallel.pp_size=2"]),
        # zb-v: rank 0 holds both the embedding and the head (stages in a V)
        ("gpt_tiny.yaml", ["parallel.pp_size=2", "parallel.vp_size=2", "parallel.schedule=zb-v"]),
        ("llama_tiny.yaml", ["parallel.pp_size=2", "parallel.vp_size=2", "parallel.schedule=zb-v"]),
        ("moe_tiny.yaml", ["parallel.tp_size=2", "parallel.pp_size=2"]),  # every layer MoE, replicated over tp
        # OLMoE's q/k norm (tp=1 only) and Qwen2's q, k, v biases alone
        ("llama_tiny.yaml", ["parallel.pp_size=2", "model.qk_layernorm=true", "model.add_qkv_bias=true"]),
    ],
)
def test_rank_params_equal_the_meta_model(config_name, overrides):
    config = load_config(os.path.join(REPO_ROOT, "configs", config_name), overrides + ["model.vocab_size=1000"])
    par = config.parallel
    layout = layout_from_config(config, par.tp_size * par.pp_size)
    for pp_rank in range(par.pp_size):
        meta = count(meta_chunks(config, tp_rank=par.tp_size - 1, pp_rank=pp_rank, dp_size=1))
        roles = RunShape.of(config, layout).chunk_roles(pp_rank)
        assert rank_params(config.model, par.tp_size, par.pp_size, roles) == meta
    assert total_params(config.model) == total_parameters(config)


@pytest.mark.parametrize(
    "config_name, overrides",
    [
        ("gpt_tiny.yaml", ["parallel.tp_size=2", "parallel.pp_size=2", "parallel.sequence_parallel=true"]),
        ("llama_tiny.yaml", ["parallel.tp_size=2", "parallel.pp_size=2", "parallel.vp_size=2"]),
        ("gpt_tiny.yaml", ["parallel.pp_size=2", "parallel.vp_size=2", "parallel.schedule=zb-v"]),
        ("gpt_tiny.yaml", ["model.position_embedding_type=rope", "model.normalization=rmsnorm"]),
        ("moe_tiny.yaml", ["parallel.tp_size=2", "parallel.pp_size=2", "parallel.sequence_parallel=true"]),
        (
            "moe_tiny.yaml",
            ["model.moe_layer_freq=2", "model.activation=swiglu", "model.moe_shared_expert_gate=true"],
        ),
        ("llama_tiny.yaml", ["parallel.pp_size=2", "model.qk_layernorm=true", "model.add_qkv_bias=true"]),
    ],
)
def test_chunk_parameters_list_the_built_chunks_in_order(config_name, overrides):
    """model/shape.chunk_parameters (what the planner cuts gradient buckets from) is the built chunk's
    parameters() in order, with their sizes and the flags the gradient reductions read."""
    config = load_config(os.path.join(REPO_ROOT, "configs", config_name), overrides + ["model.vocab_size=1000"])
    par = config.parallel
    shape = RunShape.of(config, layout_from_config(config, par.tp_size * par.pp_size))
    for pp_rank in range(par.pp_size):
        built = meta_chunks(config, tp_rank=par.tp_size - 1, pp_rank=pp_rank, dp_size=1)
        for chunk, placement in zip(built, shape.chunks(pp_rank), strict=True):
            listed = chunk_parameters(
                config.model,
                par.tp_size,
                placement.layer_ids,
                placement.pre_process,
                placement.post_process,
                par.sequence_parallel,
            )
            params = dict(chunk.named_parameters())
            assert [p.name for p in listed] == list(params)
            for p in listed:
                info = param_info(params[p.name])
                assert (p.numel, p.shared_embedding, p.sequence_parallel) == (
                    params[p.name].numel(),
                    info.shared_embedding,
                    info.sequence_parallel,
                ), p.name


def test_paper_1t_total():
    config = load_config(os.path.join(REPO_ROOT, "configs", "paper", "gpt_1t.yaml"))
    assert round(total_params(config.model) / 1e9, 1) == 1008.0


def shape(tp=1, sp=False, attention="materialized", value_bytes=2):
    return ActivationShape(
        seq_length=2048,
        local_seq=2048,
        micro_batch=2,
        hidden=4096,
        heads=32,
        query_groups=32,
        ffn=16384,
        swiglu=False,
        tp_size=tp,
        sequence_parallel=sp,
        value_bytes=value_bytes,
        attention=attention,
    )


def test_korthikanti_formulas():
    s, b, h, a = 2048, 2, 4096, 32
    sbh = s * b * h
    assert layer_activation_bytes(shape(), "none") == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert layer_activation_bytes(shape(tp=8), "none") == pytest.approx(sbh * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert layer_activation_bytes(shape(tp=8, sp=True), "none") == pytest.approx(sbh * (34 / 8 + 5 * a * s / (h * 8)))
    assert layer_activation_bytes(shape(tp=8, sp=True), "selective") == pytest.approx(sbh * 34 / 8)
    assert layer_activation_bytes(shape(tp=8), "full") == pytest.approx(2 * sbh)
    assert layer_activation_bytes(shape(tp=8, sp=True), "full") == pytest.approx(2 * sbh / 8)
    # a fused (flash) attention keeps no [s, s] tensor: only a fp32 log-sum-exp per query row
    assert layer_activation_bytes(shape(attention="flash"), "none") == pytest.approx(sbh * 34 + 4 * s * b * a)


def test_optimizer_state_bytes_match_the_measured_table():
    # docs/performance.md "Optimizer memory": B/param = params + grads + optimizer
    total = lambda precision, dist, dp: sum(state_bytes_per_param(precision, dist, dp).values())  # noqa: E731
    assert total("bf16", False, 4) == 18 and total("bf16", True, 2) == 12 and total("bf16", True, 4) == 9
    assert total("fp32", False, 2) == 16 and total("fp32", True, 1) == 20 and total("fp32", True, 4) == 11


def test_in_flight_is_the_executors_bound():
    p, m = 4, 8
    for r in range(p):
        assert max_in_flight(build_schedule("1f1b", p, r, m)) == p - r
        assert max_in_flight(build_schedule("gpipe", p, r, m)) == m
        assert max_in_flight(build_schedule("interleaved", p, r, m, 2)) == min(2 * (p - r - 1) + p + 1, 2 * m)


# docs/performance.md "CPU memory per rank (tiny config)": (overrides, dp, measured MiB of params, grads,
# optimizer, activations). fp32; torch's CPU dropout keeps a float noise tensor (mask = 4 bytes) and its
# scaled_dot_product_attention keeps no [s, s] tensor unless attention dropout sends it down the math path.
MEASURED = [
    ([], 1, 24.7, 24.7, 49.5, 263.6),
    (["train.recompute=selective"], 1, 24.7, 24.7, 49.5, 263.3),
    (["train.recompute=full"], 1, 24.7, 24.7, 49.5, 23.1),
    (["model.attention_dropout=0.1"], 1, 24.7, 24.7, 49.5, 487.3),
    (["model.attention_dropout=0.1", "train.recompute=selective"], 1, 24.7, 24.7, 49.5, 263.3),
    (["parallel.distributed_optimizer=true"], 2, 24.7, 24.7, 37.1, 263.6),
    (["parallel.distributed_optimizer=true"], 4, 24.7, 24.7, 18.5, 263.6),
]


@pytest.mark.parametrize("overrides, dp, params, grads, optimizer, activations", MEASURED)
def test_memory_model_agrees_with_the_measured_cpu_figures(overrides, dp, params, grads, optimizer, activations):
    # Twin of scripts/benchmarks/bench_cpu_memory.py's MODEL: MEASURED holds that benchmark's figures.
    base = [
        "model.hidden_size=256",
        "model.num_layers=8",
        "model.seq_length=256",
        "model.num_attention_heads=4",
        "model.hidden_dropout=0.0",
        "model.attention_dropout=0.0",
        "train.micro_batch_size=8",
        "model.vocab_size=257",
        f"train.global_batch_size={8 * dp}",
    ]
    config = load_config(os.path.join(REPO_ROOT, "configs", "gpt_tiny.yaml"), base + overrides)
    attention = "materialized" if config.model.attention_dropout > 0 else "flash"
    layout = Layout(1, 1, 1, dp, 1, "1f1b")
    cpu_shape = shape_from_config(config, layout, attention=attention)
    cpu_shape = ActivationShape(**{**cpu_shape.__dict__, "mask_bytes": 4})
    memory = layout_memory(config.model, layout, config.train, config.parallel.distributed_optimizer, cpu_shape, 0.0)
    assert memory.params == 6_482_432
    predicted = [memory.weights, memory.grads, memory.optimizer, memory.activations]
    for got, measured in zip(predicted, [params, grads, optimizer, activations]):
        assert got / MIB == pytest.approx(measured, rel=0.15)
    assert sum(predicted) / MIB == pytest.approx(params + grads + optimizer + activations, rel=0.15)


def test_head_keeps_fp32_logits():
    s = shape(tp=8)
    assert head_activation_bytes(s, 51200) == pytest.approx(2 * 2048 * 2 * 4096 * 2 + 4 * 2048 * 2 * 51200 / 8)
