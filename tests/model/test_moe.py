"""model/moe/: the MoE layer against transformers' Mixtral, OLMoE and Qwen2-MoE blocks with copied weights, the
router's losses and token dropping against megatron-core 0.16.1's moe_utils, the grouped matrix multiply
against the per-expert loop, a hand-computed capacity case, the expert bias, and the config's refusals."""

from dataclasses import replace
from typing import Any

import pytest
import torch

from model.config import ModelConfig
from model.moe import routing
from model.moe.experts import grouped_mm, grouped_mm_applies, loop_mm
from model.moe.layer import MoELayer

pytestmark = pytest.mark.tier("fast")

HIDDEN, FFN, SEQ, BATCH = 16, 32, 6, 3  # widths a multiple of 4: fp32 rows 16-byte aligned (grouped mm runs)


def moe_config(**overrides: object) -> ModelConfig:
    base = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        activation="swiglu",
        add_bias_linear=False,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=FFN,
    )
    cfg = ModelConfig(**{**base, **overrides})  # type: ignore[arg-type]
    cfg.validate()
    return cfg


def copy_routed(layer: MoELayer, hf_block: Any) -> None:  # transformers' block: its submodules by name
    with torch.no_grad():
        layer.router.weight.copy_(hf_block.gate.weight)
        layer.experts.fc1_weight.copy_(hf_block.experts.gate_up_proj)  # [E, 2f, h]: [gate; up] as ours
        layer.experts.fc2_weight.copy_(hf_block.experts.down_proj)


def random_init(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def hf_output(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' block on [b, s, h], returned as [s, b, h]."""
    with torch.no_grad():
        return block(x.transpose(0, 1).contiguous()).transpose(0, 1)


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_equals_mixtral_block(use_grouped_mm):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf_cfg = MixtralConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=4, num_experts_per_tok=2)
    block = MixtralSparseMoeBlock(hf_cfg).eval()
    random_init(block, 0)
    layer = MoELayer(moe_config(), use_grouped_mm=use_grouped_mm).eval()  # softmax over the top-k logits
    copy_routed(layer, block)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(1))
    out, bias = layer(x)
    assert bias is None
    torch.testing.assert_close(out, hf_output(block, x), rtol=1e-6, atol=1e-6)


def test_equals_olmoe_block():
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    hf_cfg = OlmoeConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False
    )
    block = OlmoeSparseMoeBlock(hf_cfg).eval()
    random_init(block, 2)
    cfg = moe_config(num_experts=8, moe_router_topk=3, moe_router_pre_softmax=True)  # top-k of the softmax
    layer = MoELayer(cfg).eval()
    copy_routed(layer, block)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(layer(x)[0], hf_output(block, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_equals_qwen2_moe_block_with_its_gated_shared_expert(norm_topk_prob):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    shared = 24
    hf_cfg = Qwen2MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=FFN,
        shared_expert_intermediate_size=shared,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
    )
    block = Qwen2MoeSparseMoeBlock(hf_cfg).eval()
    random_init(block, 4)
    cfg = moe_config(
        moe_router_pre_softmax=not norm_topk_prob,  # renormalised top-k of the softmax = softmax of the top-k
        moe_shared_expert_ffn_hidden_size=shared,
        moe_shared_expert_gate=True,
    )
    layer = MoELayer(cfg).eval()
    copy_routed(layer, block)
    with torch.no_grad():
        assert layer.shared_experts is not None and layer.shared_experts.gate_weight is not None
        hf_shared = block.shared_expert
        layer.shared_experts.fc1.weight.copy_(torch.cat([hf_shared.gate_proj.weight, hf_shared.up_proj.weight]))
        layer.shared_experts.fc2.weight.copy_(hf_shared.down_proj.weight)
        layer.shared_experts.gate_weight.copy_(block.shared_expert_gate.weight)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(layer(x)[0], hf_output(block, x), rtol=1e-6, atol=1e-6)


def megatron_moe_utils():
    # Fails (not skips) where megatron-core is missing: the reference is the point of these tests.
    from megatron.core.transformer.moe import moe_utils

    return moe_utils


@pytest.mark.parametrize(
    "score_function, pre_softmax, scaling", [("softmax", False, None), ("softmax", True, 2.5), ("sigmoid", False, None)]
)
def test_routing_and_losses_equal_megatron_core(score_function, pre_softmax, scaling):
    mcore = megatron_moe_utils()
    num_tokens, num_experts, topk = 40, 8, 3
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(6)) * 2
    probs, routing_map = routing.topk_routing(logits, topk, score_function, pre_softmax, scaling, None)
    expected_probs, expected_map = mcore.topk_routing_with_score_function(
        logits, topk, use_pre_softmax=pre_softmax, scaling_factor=scaling, score_function=score_function
    )
    assert torch.equal(routing_map, expected_map) and torch.equal(probs, expected_probs)

    loss_map, scores = routing.scores_for_aux_loss(logits, topk, score_function)
    expected_loss_map, expected_scores = mcore.compute_routing_scores_for_aux_loss(logits, topk, score_function)
    assert torch.equal(loss_map, expected_loss_map) and torch.equal(scores, expected_scores)
    tokens_per_expert = loss_map.sum(dim=0)
    aux = routing.switch_load_balancing_loss(scores, tokens_per_expert, num_tokens, topk, num_experts, 1e-2)
    expected_aux = mcore.switch_load_balancing_loss_func(scores, tokens_per_expert, num_tokens, topk, num_experts, 1e-2)
    assert torch.equal(aux, expected_aux) and aux > 0
    assert torch.equal(routing.z_loss(logits, 1e-3), mcore.z_loss_func(logits, 1e-3))


def test_sequence_aux_loss_is_the_mean_of_each_sequences_switch_loss():
    """megatron-core's [s, b x E] view against its Switch loss run on each sequence alone."""
    mcore = megatron_moe_utils()
    seq, batch, num_experts, topk = 10, 4, 6, 2
    logits = torch.randn(seq * batch, num_experts, generator=torch.Generator().manual_seed(7))  # sequence first
    loss_map, scores = routing.scores_for_aux_loss(logits, topk, "softmax")
    seq_loss = routing.sequence_load_balancing_loss(scores, loss_map, seq, batch, topk, num_experts, 1e-2)
    per_sequence = []
    for b in range(batch):
        rows = torch.arange(seq) * batch + b  # token t of [s x b] is position t // b of sequence t % b
        per_sequence.append(
            mcore.switch_load_balancing_loss_func(scores[rows], loss_map[rows].sum(dim=0), seq, topk, num_experts, 1e-2)
        )
    torch.testing.assert_close(seq_loss, torch.stack(per_sequence).mean(), rtol=1e-6, atol=0)


def test_attached_losses_reach_the_gradients():
    """backward of the layer's output adds the aux and z-losses' gradients: equal to backward of their sum."""
    cfg = moe_config(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_shared_expert_ffn_hidden_size=8)
    layer = MoELayer(cfg).train()
    plain = MoELayer(replace(cfg, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)).train()
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(8))
    layer(x)[0].square().sum().backward()
    assert set(layer.router.last_losses) == {"aux_loss", "z_loss"}
    logits = plain.router.logits(x.reshape(-1, HIDDEN))
    loss_map, scores = routing.scores_for_aux_loss(logits, 2, "softmax")
    aux = routing.switch_load_balancing_loss(scores, loss_map.sum(dim=0), SEQ * BATCH, 2, 4, 1e-2)
    z = routing.z_loss(logits, 1e-3)
    (plain(x)[0].square().sum() + aux + z).backward()
    assert plain.router.last_losses == {}
    torch.testing.assert_close(layer.router.last_losses["aux_loss"], aux.detach())
    for (name, param), reference in zip(layer.named_parameters(), plain.parameters()):
        assert param.grad is not None and reference.grad is not None, name
        torch.testing.assert_close(param.grad, reference.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_grouped_mm_equals_the_per_expert_loop():
    generator = torch.Generator().manual_seed(9)
    tokens_per_expert = torch.tensor([3, 0, 7, 2])  # an expert with no tokens too
    x = torch.randn(12, 16, generator=generator, requires_grad=True)
    weights = torch.randn(4, 8, 16, generator=generator, requires_grad=True)
    assert grouped_mm_applies(x, weights)  # the private path runs here, not the loop again
    x_ref, weights_ref = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    out, expected = grouped_mm(x, weights, tokens_per_expert), loop_mm(x_ref, weights_ref, tokens_per_expert)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    out.sum().backward()  # an expanded (zero-stride) gradient
    expected.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weights.grad, weights_ref.grad, rtol=1e-6, atol=1e-6)
    assert not grouped_mm_applies(torch.randn(4, 6), torch.randn(2, 8, 6))  # 24-byte rows: the loop


def capacity_case() -> tuple[torch.Tensor, torch.Tensor]:
    """4 tokens, 2 experts, top-1: tokens 0, 1, 2 go to expert 0 (weights .6 .9 .7), token 3 to expert 1 (.8)."""
    probs = torch.tensor([[0.6, 0.0], [0.9, 0.0], [0.7, 0.0], [0.0, 0.8]])
    return probs, probs > 0


def test_capacity_drops_by_probability_and_by_position():
    probs, routing_map = capacity_case()
    assert routing.expert_capacity(4 * 1, 2, 1.0) == 2  # ceil(4 / 2 x 1.0)
    by_probs, map_by_probs = routing.drop_tokens(probs, routing_map, 1, 1.0, "probs", False)
    assert map_by_probs.tolist() == [[False, False], [True, False], [True, False], [False, True]]  # .6 dropped
    assert torch.equal(by_probs, probs * map_by_probs)
    expected = megatron_moe_utils().apply_router_token_dropping(probs, routing_map, 1, 1.0, "probs", False)
    assert torch.equal(by_probs, expected[0]) and torch.equal(map_by_probs, expected[1])
    _, map_by_position = routing.drop_tokens(probs, routing_map, 1, 1.0, "position", False)
    assert map_by_position.tolist() == [[True, False], [True, False], [False, False], [False, True]]  # token 2 dropped
    padded_probs, padded_map = routing.drop_tokens(probs, routing_map, 1, 1.0, "position", True)
    assert padded_map.sum(dim=0).tolist() == [2, 2]  # every expert at capacity
    assert padded_map[:, 1].tolist() == [True, False, False, True]  # token 3, then the earliest other: token 0
    assert padded_probs[:, 1].tolist() == [0.0, 0.0, 0.0, pytest.approx(0.8)]  # the padding weighs nothing
    generous, generous_map = routing.drop_tokens(probs, routing_map, 1, 2.0, "probs", False)  # capacity 4
    assert torch.equal(generous_map, routing_map) and torch.equal(generous, probs)


def test_dropped_tokens_get_no_expert_output():
    cfg = moe_config(moe_expert_capacity_factor=0.5)  # ceil(18 x 2 / 4 x 0.5) = 5 of ~9 rows per expert
    layer = MoELayer(cfg).eval()
    dropless = MoELayer(replace(cfg, moe_expert_capacity_factor=None)).eval()
    dropless.load_state_dict(layer.state_dict())
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(10))
    tokens = x.reshape(-1, HIDDEN)
    with torch.no_grad():
        _, kept = layer.router(tokens, SEQ, BATCH)
        _, routed = dropless.router(tokens, SEQ, BATCH)
        out, full = layer(x)[0].reshape(-1, HIDDEN), dropless(x)[0].reshape(-1, HIDDEN)
    assert kept.sum(dim=0).max() <= 5 and kept.sum() < routed.sum()
    fully_kept = (kept == routed).all(dim=1)
    torch.testing.assert_close(out[fully_kept], full[fully_kept])
    assert not torch.allclose(out[~fully_kept], full[~fully_kept])


def test_expert_bias_changes_the_selection_not_the_weights():
    logits = torch.randn(20, 4, generator=torch.Generator().manual_seed(11))
    _, routing_map = routing.topk_routing(logits, 2, "sigmoid", False, None, None)
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 wins every selection
    biased_probs, biased_map = routing.topk_routing(logits, 2, "sigmoid", False, None, bias)
    assert biased_map[:, 3].all() and not torch.equal(biased_map, routing_map)
    scores = torch.sigmoid(logits) * biased_map
    torch.testing.assert_close(biased_probs, scores / scores.sum(dim=-1, keepdim=True))  # unbiased scores
    expected = megatron_moe_utils().topk_routing_with_score_function(
        logits, 2, score_function="sigmoid", expert_bias=bias
    )
    assert torch.equal(biased_probs, expected[0]) and torch.equal(biased_map, expected[1])


def test_the_router_counts_selections_and_steps_its_expert_bias():
    cfg = moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    layer = MoELayer(cfg).train()
    assert "router.expert_bias" in layer.state_dict() and "router.tokens_per_expert" not in layer.state_dict()
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(12))
    _, routing_map = layer.router(x.reshape(-1, HIDDEN), SEQ, BATCH)
    counts = routing_map.sum(dim=0).float()
    assert layer.router.tokens_per_expert is not None and layer.router.expert_bias is not None
    assert torch.equal(layer.router.tokens_per_expert, counts)
    layer.router.update_expert_bias()
    expected = torch.sign(counts.mean() - counts) * cfg.moe_router_bias_update_rate  # below the mean: up
    assert torch.equal(layer.router.expert_bias, expected)
    assert not layer.router.tokens_per_expert.any()
    with torch.no_grad():  # evaluation does not count
        layer.router(x.reshape(-1, HIDDEN), SEQ, BATCH)
    assert not layer.router.tokens_per_expert.any()


def test_moe_layer_freq_picks_the_layers():
    assert [moe_config(num_layers=4, moe_layer_freq=2).is_moe_layer(i) for i in range(4)] == [1, 0, 1, 0]
    first_dense = moe_config(num_layers=4, moe_layer_freq=[0, 1, 1, 1])
    assert [first_dense.is_moe_layer(i) for i in range(4)] == [0, 1, 1, 1]
    assert not any(ModelConfig().is_moe_layer(i) for i in range(4))  # dense by default


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"moe_router_topk": 5}, "model.moe_router_topk=5 is more than model.num_experts=4"),
        ({"moe_expert_capacity_factor": 0.0}, "model.moe_expert_capacity_factor=0.0 must be > 0"),
        ({"moe_router_enable_expert_bias": True}, "model.moe_router_enable_expert_bias=true needs"),
        ({"moe_router_topk": 1}, "model.moe_router_topk=1 with softmax scores needs model.moe_router_pre_softmax"),
        ({"moe_layer_freq": [1, 0, 1]}, "model.moe_layer_freq=[1, 0, 1] must be one 0 or 1 per layer"),
        ({"moe_layer_freq": 0}, "model.moe_layer_freq=0 must be >= 1"),
        ({"moe_pad_expert_input_to_capacity": True}, "needs model.moe_expert_capacity_factor"),
        ({"moe_router_score_function": "relu"}, "model.moe_router_score_function='relu' is not one of"),
        ({"num_experts": -1}, "model.num_experts=-1 must be >= 0"),
    ],
)
def test_bad_moe_settings_are_refused_with_one_line(overrides, message):
    with pytest.raises(ValueError) as refusal:
        moe_config(**overrides)
    assert message in str(refusal.value) and "\n" not in str(refusal.value)


def test_gpt_model_holds_moe_layers_where_moe_layer_freq_says():
    from model.gpt import MLP, GPTModel

    model = GPTModel(moe_config(num_layers=4, moe_layer_freq=[0, 1, 1, 0]), padded_vocab_size=128)
    assert [layer_id for layer_id, _ in model.moe_layers()] == [1, 2]
    assert isinstance(model.layers["0"].mlp, MLP) and isinstance(model.layers["3"].mlp, MLP)
    assert "layers.1.mlp.experts.fc1_weight" in dict(model.named_parameters())


def test_layout_free_init_gives_the_moe_weights_megatrons_rules():
    """model/init.py draws every MoE parameter by its global name: fc1 and the router at init_std, the routed
    experts' stacked fc2 [E, h, f] and the shared expert's fc2 at init_std / sqrt(2 x layers), biases (the
    stacked ones too) zero, the expert bias buffer zero; the same draw whatever module builds it."""
    from model.gpt import GPTModel
    from model.init import draw_full_parameter, initialize_parameters, scaled_init_std

    cfg = moe_config(
        num_layers=2,
        num_experts=8,
        moe_ffn_hidden_size=256,
        add_bias_linear=True,
        moe_shared_expert_ffn_hidden_size=256,
        moe_shared_expert_gate=True,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
    )
    with torch.device("meta"):
        model = GPTModel(cfg, padded_vocab_size=128)
    initialize_parameters(model, cfg, seed=7)
    params = dict(model.named_parameters())
    layer = "layers.1.mlp."
    for name in ("router.weight", "experts.fc1_weight", "shared_experts.fc1.weight", "shared_experts.gate_weight"):
        assert params[layer + name].std().item() == pytest.approx(cfg.init_std, rel=0.1), name
    for name in ("experts.fc2_weight", "shared_experts.fc2.weight"):
        assert params[layer + name].std().item() == pytest.approx(scaled_init_std(cfg), rel=0.1), name
    for name in ("router.bias", "experts.fc1_bias", "experts.fc2_bias", "shared_experts.fc2.bias"):
        assert not params[layer + name].any(), name
    bias = dict(model.named_buffers())[layer + "router.expert_bias"]
    assert not bias.is_meta and not bias.any() and bias.dtype == torch.float32
    # layout-free: the stacked experts are one draw from (seed, global name)
    full = draw_full_parameter(layer + "experts.fc1_weight", (8, 256 * 2, HIDDEN), cfg, seed=7)
    torch.testing.assert_close(params[layer + "experts.fc1_weight"], full, rtol=0, atol=0)


def test_model_build_hands_the_kernels_and_the_ep_exchange_to_the_moe_layers():
    """The RankSpec reaches every MoE layer: model.fused_kernel_names=[grouped_mm] selects the grouped_mm
    kernel in the experts (model/kernels.fuses_grouped_mm decides per device), and an ep exchange of 2 ranks
    leaves rank 1 holding experts [2, 4) of 4, their global range in ParamInfo.experts."""
    from model.gpt import GPTModel
    from model.param_info import param_info
    from model.rank_spec import RankSpec

    class TwoRanks:  # the dispatcher's view of an ep group; the build itself sends nothing
        ep_size, ep_rank = 2, 1

        def all_to_all(self, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
            raise AssertionError("building a model exchanges no tokens")

    cfg = moe_config(fused_kernels=True, fused_kernel_names=["grouped_mm"])
    spec = replace(RankSpec.one_process(cfg), expert_exchange=TwoRanks())
    with torch.device("meta"):
        model = GPTModel(cfg, padded_vocab_size=128, spec=spec)
    for _, moe in model.moe_layers():
        assert moe.experts.kernels.uses("grouped_mm") and not moe.experts.kernels.uses("norm")
        assert moe.experts.fc1_weight.shape[0] == 2
        info = param_info(moe.experts.fc1_weight)
        assert info.experts == (2, 4) and info.full_shape == (4, *moe.experts.fc1_weight.shape[1:])
    with torch.device("meta"):
        plain = GPTModel(moe_config(), padded_vocab_size=128)
    assert not any(moe.experts.kernels.uses("grouped_mm") for _, moe in plain.moe_layers())
