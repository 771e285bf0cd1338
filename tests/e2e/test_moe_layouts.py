"""A Mixture-of-Experts model trains the same at every layout as one process, through the real trainer.

The model is configs/moe_tiny.yaml's (4 layers, hidden 128, seq 128, global batch 16: 2048 tokens per
iteration; 8 experts, top-2, one shared expert, the Switch loss and the z-loss on, dropless) on the tests' tiny
corpus, through tests/e2e/test_layouts.py's `train` and `assert_matches`: 10 iterations, fp32, dropout 0,
lm_loss and grad_norm within 1e-5 relative of one process. Top-k routing is discontinuous: a token whose two
candidate experts' logits lie a last bit apart can go to either at layouts whose arithmetic differs in that
bit. At the tests' own tiny model (hidden 32, 256 tokens per iteration) one such token moved the grad norm by
up to 1.1e-4; at moe_tiny's size each token weighs 8x less, which is why these cases use it. The margin left
(measured once in the one-process run): the smallest gap between a token's 2nd and 3rd router logit over the
10 iterations is 8.9e-8 (about 12 ulps, iteration 9); with sigmoid scores and the expert bias, 6e-8 (one ulp
of a score of 0.54). Every case passes, but a change of arithmetic can still flip such a token.

At ep = 1 the experts and the router are replicated over tp (model/gpt.build_moe_layer): these layouts check
that their gradients are reduced as other replicated parameters' are, and that the auxiliary losses reach the
gradients as in one process's sum over micro-batches. At ep > 1 (parallel.ep_size) each rank holds E / ep
experts and the tokens go to them by all-to-all over the ep group (carved from dp x cp): the cases combine it
with tp + sequence parallelism, pp (1f1b, interleaved), cp, the distributed optimizer, FSDP, the expert bias
and token dropping. All in the full tier (the fast tier has the MoE layer's ep parity).
"""

from __future__ import annotations

import os

import pytest
import yaml

from tests import tiers
from tests.conftest import REPO_ROOT
from tests.e2e.test_layouts import FAST, INTERLEAVED, assert_matches, train

# moe_tiny's size (10-20 CPU s a case, the one-process references ~10 each): the full tier; the fast tier's
# expert-parallel parity is the MoE layer's (tests/parallel/test_expert_parallel.py, tiers.FAST_PARITY)
pytestmark = pytest.mark.tier("full")


def moe_tiny() -> dict:
    """configs/moe_tiny.yaml, as loaded."""
    with open(os.path.join(REPO_ROOT, "configs", "moe_tiny.yaml")) as handle:
        return yaml.safe_load(handle)


def moe_tiny_overrides() -> tuple[str, ...]:
    """configs/moe_tiny.yaml's MoE keys, as overrides."""
    model = moe_tiny()["model"]
    keys = [key for key in model if key == "num_experts" or key.startswith("moe_")]
    return tuple(f"model.{key}={'null' if model[key] is None else model[key]}" for key in keys)


def moe_tiny_sizes() -> tuple[str, ...]:
    """configs/moe_tiny.yaml's model sizes and batch, as overrides of the tests' tiny ones
    (tests/conftest.tiny_train_args)."""
    config = moe_tiny()
    sizes = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
    model = [f"model.{key}={config['model'][key]}" for key in sizes]
    batch = [f"train.{key}={config['train'][key]}" for key in ("micro_batch_size", "global_batch_size")]
    return (*model, *batch)


MOE = (*moe_tiny_sizes(), *moe_tiny_overrides())
# Aux-loss-free balancing: sigmoid scores and the expert bias, stepped after each optimizer step from the
# selections counted over the global batch.
EXPERT_BIAS = ("model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true")
SEQ_AUX = ("model.moe_router_load_balancing_type=seq_aux_loss",)
# Token dropping: each expert takes at most its even share of a micro-batch's selections.
DROPPING = ("model.moe_expert_capacity_factor=1.0",)
TP2_SP = ("parallel.tp_size=2", "parallel.sequence_parallel=true")
EP2 = ("parallel.ep_size=2",)


@pytest.fixture(scope="module")
def moe_reference(tiny_corpus, tmp_path_factory):
    """moe_reference(*model_overrides) -> the single-process metrics of the MoE model, computed once each."""
    cache: dict[tuple, list[dict]] = {}

    def get(*model_overrides: str) -> list[dict]:
        if model_overrides not in cache:
            run_dir = str(tmp_path_factory.mktemp("moe_reference"))
            cache[model_overrides] = train(tiny_corpus, run_dir, 1, *FAST, *MOE, *model_overrides)
        return cache[model_overrides]

    return get


# (id, world size, model overrides shared with the reference, parallel overrides)
LAYOUTS = [
    ("ep2", 2, (), EP2),
    ("ep4-dp4", 4, (), ("parallel.ep_size=4",)),
    ("ep2-tp2-sp", 4, (), (*EP2, *TP2_SP)),
    ("ep2-pp2-1f1b", 4, (), (*EP2, "parallel.pp_size=2", "parallel.schedule=1f1b")),
    ("ep2-pp2-vp2", 4, (), (*EP2, "parallel.pp_size=2", *INTERLEAVED)),
    ("ep2-cp2", 2, (), (*EP2, "parallel.cp_size=2")),
    ("ep2-distopt", 2, (), (*EP2, "parallel.distributed_optimizer=true")),
    ("ep2-fsdp", 2, (), (*EP2, "parallel.fsdp=true")),
    ("ep2-tp2-pp2-dp2", 8, (), (*EP2, "parallel.tp_size=2", "parallel.pp_size=2")),
    ("ep2-expert_bias", 2, EXPERT_BIAS, EP2),
    ("ep2-dropping", 2, DROPPING, EP2),
    # ep = 1: what the ep cases above do not cover. Each ep case also runs its ep = 1 counterpart's code (tp
    # with and without sp, pp 1f1b and interleaved, cp, the distributed optimizer, the expert bias over dp),
    # so those are not repeated here (each costs 10-20 CPU s at moe_tiny's size).
    ("pp2-zb-v", 2, (), ("parallel.pp_size=2", "parallel.vp_size=2", "parallel.schedule=zb-v")),
    ("cp2-seq_aux_loss", 2, SEQ_AUX, ("parallel.cp_size=2",)),
    ("tp2-sp-seq_aux_loss", 2, SEQ_AUX, TP2_SP),
    ("tp2-sp-expert_bias", 2, EXPERT_BIAS, TP2_SP),
    ("fsdp-dp2", 2, (), ("parallel.fsdp=true",)),
]


@pytest.mark.parametrize(
    "world_size,model_overrides,parallel_overrides",
    [tiers.layout_case(case[0], *case[1:], fast=set()) for case in LAYOUTS],
)
def test_moe_layout_matches_single_process(
    tiny_corpus, tmp_path, moe_reference, world_size, model_overrides, parallel_overrides
):
    records = train(tiny_corpus, str(tmp_path / "run"), world_size, *FAST, *MOE, *model_overrides, *parallel_overrides)
    reference = moe_reference(*model_overrides)
    assert_matches(records, reference)
    # the routing metrics are the global batch's at every layout too (the mean over dp, the parts of a
    # micro-batch summed over its token group)
    routing = ("moe_load_balancing_loss", "moe_z_loss", "moe_max_load", "moe_dropped_fraction")
    assert_matches(records, reference, keys=routing)


def test_moe_run_logs_its_routing_metrics(tiny_corpus, tmp_path, moe_reference):
    """One process: the losses are on, nothing is dropped (dropless), and the busiest expert's load is at
    least the mean (a ratio >= 1) in every iteration's metrics.jsonl line."""
    records = moe_reference()
    for record in records:
        assert record["moe_load_balancing_loss"] > 0 and record["moe_z_loss"] > 0
        assert record["moe_dropped_fraction"] == 0.0 and record["moe_max_load"] >= 1.0


def independent_iteration_flops(model: dict, vocab_size: int, global_batch: int) -> float:
    """One training iteration's matrix-multiply FLOPs of a GPT whose every layer is an MoE layer, counted here
    from the config (not by model/shape.py): per token and layer q, k, v and the attention projection (4 h^2
    multiply-adds), attention's two batched matmuls over the full sequence (2 s h), the router (h E), top_k
    routed experts and the shared expert (fc1 and fc2, each h f; GeLU experts), and the logits (h V, V the
    vocabulary padded to a multiple of 8); 2 FLOPs per multiply-add, forward + backward = 3 x the forward."""
    h, s, num_experts = model["hidden_size"], model["seq_length"], model["num_experts"]
    routed = model["moe_router_topk"] * 2 * h * model["moe_ffn_hidden_size"]
    shared = 2 * h * model["moe_shared_expert_ffn_hidden_size"]
    per_layer = 4 * h * h + 2 * s * h + h * num_experts + routed + shared
    padded_vocab = -(-vocab_size // 8) * 8
    multiply_adds = global_batch * s * (model["num_layers"] * per_layer + h * padded_vocab)
    return 3 * 2 * multiply_adds


@pytest.mark.tier("full")
def test_moe_iteration_flops_count_the_experts_used(tiny_corpus, tmp_path):
    """An ep2 run logs each iteration's model FLOPs (model_tflops_per_device x seconds x ranks) equal, within
    1%, to an independent count of the matrix multiplies that top_k routed experts and the shared expert do
    (not all E experts), and its config.yaml holds the MoE keys and parallel.ep_size."""
    import json

    run_dir = tmp_path / "run"
    records = train(tiny_corpus, str(run_dir), 2, *FAST, *MOE, *EP2, iterations=2)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    moe_keys = {key: value for key, value in moe_tiny()["model"].items() if "moe" in key or "experts" in key}
    assert {key: saved["model"][key] for key in moe_keys} == moe_keys and saved["parallel"]["ep_size"] == 2
    with open(tiny_corpus["vocab_file"]) as handle:
        vocab_size = len(json.load(handle))
    expected = independent_iteration_flops(saved["model"], vocab_size, saved["train"]["global_batch_size"])
    for record in records:
        logged = record["model_tflops_per_device"] * 1e12 * record["ms_per_iter"] / 1e3 * record["world_size"]
        assert logged == pytest.approx(expected, rel=0.01)
