"""model/shape.py: the logged FLOPs against torch's count of a real forward and backward, the paper's formula,
and the structural keys marked on ModelConfig."""

import functools
import glob
import os
from types import SimpleNamespace
from typing import cast

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from config.schema import load_config
from model.config import checkpoint_keys
from model.gpt import GPTModel
from model.rank_spec import RankSpec, Recompute
from model.shape import ParamShape, fsdp_shard_rows, iteration_flops, recomputed_layers
from tests.conftest import REPO_ROOT
from training.logging import IntervalStats

pytestmark = pytest.mark.tier("fast")

VARIANTS = [
    ("gpt_tiny.yaml", []),
    ("llama_tiny.yaml", []),  # SwiGLU, GQA (8 heads, 4 groups), rope, rmsnorm, untied, no biases
    ("gpt_tiny.yaml", ["model.num_query_groups=2", "model.ffn_hidden_size=200"]),  # GQA, odd ffn
    ("gpt_tiny.yaml", ["model.tie_embeddings=false"]),
]
RECOMPUTE = [
    ["train.recompute=none"],
    ["train.recompute=full"],
    ["train.recompute=full", "train.recompute_method=block", "train.recompute_num_layers=3"],
    ["train.recompute=selective"],
]


def recompute_of(train, checkpoint_fn=None) -> Recompute:
    """The train section's recomputation as the model's rule (what the trainer builds)."""
    return Recompute(train.recompute, train.recompute_method, train.recompute_num_layers, checkpoint_fn)


def counted_flops(config, experts_loop: bool = False) -> float:
    """torch's count of every matmul of one forward + backward of the global batch (one process).

    The math attention path runs attention as matmuls torch counts (the fused CPU kernel is not counted), and
    recomputation re-runs the whole checkpointed forward as the paper counts it (torch's early stop would skip
    the last GEMM of each recomputed region, whose output backward does not need). `experts_loop`: the MoE
    experts run their reference, one torch.mm per expert (torch counts no FLOPs for torch._grouped_mm)."""
    m, train = config.model, config.train
    fn = functools.partial(checkpoint, use_reentrant=False)
    model = GPTModel(m, m.padded_vocab_size(1), spec=RankSpec.one_process(m, recompute_of(train, fn)))
    for _, moe in model.moe_layers():
        moe.experts.use_grouped_mm = not experts_loop
    b, s = train.global_batch_size, m.seq_length
    tokens = torch.randint(0, m.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(s).expand(b, s)
    with sdpa_kernel(SDPBackend.MATH), set_checkpoint_early_stop(False), FlopCounterMode(display=False) as counter:
        model(tokens, positions, labels=tokens).mean().backward()
    return float(counter.get_total_flops())


@pytest.mark.parametrize("recompute", RECOMPUTE, ids=lambda r: "-".join(x.split("=")[1] for x in r))
@pytest.mark.parametrize("name, overrides", VARIANTS, ids=lambda v: str(v))
def test_logged_flops_equal_torchs_count_of_the_matmuls(name, overrides, recompute):
    batch = ["train.global_batch_size=2", "train.micro_batch_size=2", "model.seq_length=64", "model.vocab_size=1000"]
    config = load_config(os.path.join(REPO_ROOT, "configs", name), overrides + batch + recompute)
    m = config.model
    flops = iteration_flops(m, m.padded_vocab_size(1), config.train.global_batch_size, recompute_of(config.train))
    stats = IntervalStats(flops, 2 * 64, world_size=1, device_type="cpu", peak_tflops=1.0)
    stats.add(SimpleNamespace(loss=1.0, skipped=False, grad_norm=1.0, loss_scale=1.0, moe={}), lr=0.1, seconds=1.0)
    record = stats.flush(SimpleNamespace(iteration=1, consumed_samples=2, skipped_iters=0))
    counted = counted_flops(config)
    assert record["tflops_per_device"] * 1e12 == pytest.approx(counted, rel=0.01)  # the paper's figure
    if config.train.recompute == "none":
        assert record["model_tflops_per_device"] * 1e12 == pytest.approx(counted, rel=0.01)
    else:
        assert record["model_tflops_per_device"] < record["tflops_per_device"]
    assert record["mfu"] == pytest.approx(record["model_tflops_per_device"])  # a peak of 1 TFLOP/s


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO_ROOT, "configs", "paper", "*.yaml"))))
def test_paper_configs_give_the_papers_formula(path):
    config = load_config(path)
    m, par, train = config.model, config.parallel, config.train
    b, s, l, h = train.global_batch_size, m.seq_length, m.num_layers, m.hidden_size  # noqa: E741 (the paper's l)
    v = m.padded_vocab_size(par.tp_size)
    assert train.recompute == "full" and v == 51200
    flops = iteration_flops(m, v, b, recompute_of(train), par.pp_size * par.vp_size)
    # the paper's equation (3) with full recomputation, and 72 B s l h^2 (1 + s/6h + V/12lh) without
    assert flops.with_recompute == pytest.approx(96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)), 1e-12)
    assert flops.model == pytest.approx(72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)), 1e-12)


def test_block_recompute_counts_the_layers_of_every_chunk():
    config = load_config(os.path.join(REPO_ROOT, "configs", "gpt_tiny.yaml"))  # 8 layers
    block = Recompute("full", "block", 3)
    assert recomputed_layers(config.model, block, num_chunks=4) == 2 * 4  # 2 layers per chunk, all of them
    assert recomputed_layers(config.model, block, num_chunks=2) == 3 * 2
    assert recomputed_layers(config.model, recompute_of(config.train), num_chunks=2) == 0  # recompute none


def test_structural_keys_are_marked_on_the_config():
    assert set(checkpoint_keys("structural")) == {
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "query_groups",
        "ffn_size",
        "vocab_size",
        "max_positions",
        "position_embedding_type",
        "normalization",
        "activation",
        "tie_embeddings",
        "add_bias_linear",
        "add_qkv_bias",
        "qk_layernorm",
        "num_experts",
        "moe_layer_freq",
        "moe_ffn_hidden_size",
        "moe_shared_expert_ffn_hidden_size",
        "moe_shared_expert_gate",
        "moe_router_enable_expert_bias",
    }
    assert checkpoint_keys("resume_only") == ("seq_length", "rotary_base")


@pytest.mark.parametrize("overrides", [[], ["model.add_qkv_bias=true"]], ids=("no-bias", "qkv-bias"))
def test_gemm_count_follows_the_built_model(overrides):
    """The GEMMs of model/shape.py are the Linear layers of one built layer, in order, size and bias (Llama
    style: none, or on the qkv projection alone with model.add_qkv_bias)."""
    from model.shape import layer_gemms

    config = load_config(os.path.join(REPO_ROOT, "configs", "llama_tiny.yaml"), ["model.vocab_size=1000", *overrides])
    with torch.device("meta"):
        layer = GPTModel(config.model, config.model.padded_vocab_size(1), layer_ids=[0]).layers["0"]
    linears = [mod for mod in layer.modules() if isinstance(mod, torch.nn.Linear)]
    shapes = [(g.in_features, g.out_features, g.bias) for g in layer_gemms(config.model)]
    assert shapes == [(mod.in_features, mod.out_features, mod.bias is not None) for mod in linears]
    assert [g.bias for g in layer_gemms(config.model)] == [bool(overrides), False, False, False]


def test_fsdp_shard_rows_are_torch_chunks_split():
    """FSDP2's Shard(0) cuts dim 0 with torch.chunk and pads the missing shards: every (rows, shards) here."""
    for rows in range(0, 14):
        for shards in range(1, 6):
            chunks = torch.arange(rows).chunk(shards) if rows else ()
            for index in range(shards):
                first, end = fsdp_shard_rows(rows, shards, index)
                held = chunks[index].tolist() if index < len(chunks) else []
                assert list(range(first, end)) == held, (rows, shards, index)
            per_shard = max((len(c) for c in chunks), default=0)
            assert rows == 0 or ParamShape("w", rows * 3, rows=rows).padded_numel(shards) == per_shard * shards * 3


MOE_VARIANTS = [
    ("moe_tiny.yaml", []),  # every layer MoE: 8 experts, top-2, a shared expert
    # every other layer, SwiGLU experts, a gated shared expert: the dense and the MoE layers' counts together
    ("moe_tiny.yaml", ["model.moe_layer_freq=2", "model.activation=swiglu", "model.moe_shared_expert_gate=true"]),
]


@pytest.mark.parametrize("recompute", [RECOMPUTE[0], RECOMPUTE[2]], ids=("none", "full-block"))
@pytest.mark.parametrize("name, overrides", MOE_VARIANTS, ids=lambda v: str(v))
def test_logged_moe_flops_count_the_active_experts(name, overrides, recompute):
    """An MoE iteration's logged FLOPs are torch's count of the matmuls it ran: attention, the router, top_k
    routed experts per token (dropless: exactly T x k expert rows) and the shared expert, the output layer."""
    batch = ["train.global_batch_size=2", "train.micro_batch_size=2", "model.seq_length=64", "model.vocab_size=1000"]
    config = load_config(os.path.join(REPO_ROOT, "configs", name), overrides + batch + recompute)
    m = config.model
    flops = iteration_flops(m, m.padded_vocab_size(1), config.train.global_batch_size, recompute_of(config.train))
    assert flops.with_recompute == pytest.approx(counted_flops(config, experts_loop=True), rel=0.01)


def test_moe_parameter_counts_follow_the_built_model():
    """total_params is the built MoE model's parameter count; active_params leaves out all but top_k of each
    MoE layer's routed experts."""
    from model.shape import active_params, total_params

    config = load_config(os.path.join(REPO_ROOT, "configs", "moe_tiny.yaml"), ["model.vocab_size=1000"])
    m = config.model
    with torch.device("meta"):
        model = GPTModel(m, m.padded_vocab_size(1))
    assert total_params(m) == sum(p.numel() for p in model.parameters())
    expert_params = sum(
        p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name
    )  # all E experts of every layer
    num_experts = cast(int, m.num_experts)
    unused = expert_params * (num_experts - m.moe_router_topk) // num_experts
    assert active_params(m) == total_params(m) - unused


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_moe_counts_of_an_ep_rank_hold_its_e_over_ep_experts_whole(ep):
    """Under expert parallelism a (tp, ep) rank holds E / ep of each MoE layer's routed experts, whole on every
    tp rank, and everything else as without ep: routed_expert_params, rank_params and chunk_parameters (its
    `expert` tensors are the built model's stacked experts cut to E / ep rows) agree; with the MoE layers all on
    the first of two pipeline ranks, the rank's own layer_ids give each rank its own count."""
    from model.shape import chunk_parameters, rank_params, routed_expert_params

    overrides = ["model.vocab_size=1000", "model.moe_layer_freq=[1,1,0,0]"]
    m = load_config(os.path.join(REPO_ROOT, "configs", "moe_tiny.yaml"), overrides).model
    with torch.device("meta"):
        model = GPTModel(m, m.padded_vocab_size(1))
    built = {name: p.shape for name, p in model.named_parameters() if ".mlp.experts." in name}
    every_expert = sum(shape.numel() for shape in built.values())
    assert every_expert > 0 and routed_expert_params(m, range(m.num_layers), ep) == every_expert // ep
    for tp in (1, 2):
        listed = chunk_parameters(m, tp, range(m.num_layers), True, True, ep_size=ep)
        experts = {p.name: (p.rows, p.numel) for p in listed if p.expert}
        assert experts == {name: (shape[0] // ep, shape.numel() // ep) for name, shape in built.items()}
        held = sum(p.numel for p in listed)
        assert held == rank_params(m, tp, 1, [(True, True)], ep_size=ep)
        assert held == rank_params(m, tp, 1, [(True, True)]) - every_expert + every_expert // ep
    for layers, roles in (([0, 1], (True, False)), ([2, 3], (False, True))):
        listed = chunk_parameters(m, 1, layers, *roles, ep_size=ep)
        assert rank_params(m, 1, 2, [roles], ep, layers) == sum(p.numel for p in listed)
        assert routed_expert_params(m, layers, ep) == sum(p.numel for p in listed if p.expert)
    assert routed_expert_params(m, [2, 3], ep) == 0
