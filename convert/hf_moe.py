"""transformers' Mixture-of-Experts families <-> our MoE layers: MixtralForCausalLM, Qwen2MoeForCausalLM and
OlmoeForCausalLM.

Their attention, norms, embeddings and dense MLPs are Llama's (convert/hf_mapping.py maps those); this module
holds what differs, the router settings of config.json and the tensors of the MoE layers:

    router    ours layers.i.mlp.router.weight [E, h]               transformers ...gate.weight [E, h]
    experts   ours experts.fc1_weight [E, 2f, h], SwiGLU [gate; up] transformers experts.e.w1 (gate) [f, h],
                                                                    w3 (up) [f, h] (Qwen2-MoE: gate_proj, up_proj)
              ours experts.fc2_weight [E, h, f]                     transformers experts.e.w2 [h, f] (down_proj)
    shared    ours shared_experts.fc1.weight [2f_s, h] [gate; up]   transformers shared_expert.gate_proj, up_proj
              ours shared_experts.fc2.weight, gate_weight [1, h]    shared_expert.down_proj, shared_expert_gate
    q/k norm  ours layers.i.attention.q_norm.weight [n d], k_norm [g d]  OLMoE self_attn.q_norm, k_norm
              (model.qk_layernorm: RMSNorm over every head of the projection at once)
    routing   Mixtral: softmax over all experts, its top-k renormalised, which equals our softmax over the
              top-k logits (model.moe_router_pre_softmax=false); Qwen2-MoE and OLMoE: the top-k of the
              softmax, renormalised (norm_topk_prob=true: pre_softmax false) or not (pre_softmax true)

The prefix is `model.layers.i.block_sparse_moe.` for Mixtral, `model.layers.i.mlp.` for Qwen2-MoE and OLMoE. Experts
are written one tensor per expert, as transformers' save_pretrained writes them and the published checkpoints
hold them; transformers' in-memory fused spelling (a model's state_dict(): experts.gate_up_proj [E, 2f, h],
experts.down_proj [E, h, f], Mixtral's router under mlp.gate) is read too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from convert.hf_settings import HFSettings, UnsupportedModelError
from model.config import ModelConfig

Tensors = dict[str, torch.Tensor]

# model_type -> the architecture written to config.json
MOE_ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}

# transformers' defaults of the router settings a config.json may leave out
_DEFAULT_AUX_LOSS_COEF = 0.001


def _refuse(condition: bool, message: str) -> None:
    if condition:
        raise UnsupportedModelError(message)


def moe_family(cfg: ModelConfig) -> str:
    """'mixtral', 'qwen2_moe' or 'olmoe' (model.qk_layernorm): the transformers family an MoE model of ours is written as; a setting no
    family computes is refused in one line naming the key."""
    style = (cfg.position_embedding_type, cfg.normalization, cfg.activation)
    _refuse(
        style != ("rope", "rmsnorm", "swiglu"),
        f"model.num_experts={cfg.num_experts} with position_embedding_type={style[0]}, normalization={style[1]}, "
        f"activation={style[2]}: transformers' MoE families (Mixtral, Qwen2-MoE) are Llama style (rope/rmsnorm/swiglu)",
    )
    _refuse(cfg.add_bias_linear, "model.add_bias_linear=true: Mixtral and Qwen2-MoE have no expert or router biases")
    _refuse(
        cfg.moe_router_score_function != "softmax",
        f"model.moe_router_score_function={cfg.moe_router_score_function}: Mixtral and Qwen2-MoE route by softmax",
    )
    _refuse(
        cfg.moe_router_topk_scaling_factor not in (None, 1.0),
        f"model.moe_router_topk_scaling_factor={cfg.moe_router_topk_scaling_factor}: Mixtral and Qwen2-MoE do not "
        "scale the routing weights",
    )
    _refuse(
        cfg.moe_router_enable_expert_bias,
        "model.moe_router_enable_expert_bias=true: Mixtral and Qwen2-MoE have no expert bias in the selection",
    )
    _refuse(
        cfg.moe_expert_capacity_factor is not None,
        f"model.moe_expert_capacity_factor={cfg.moe_expert_capacity_factor}: transformers' MoE layers drop no "
        "tokens, so the exported model would compute differently",
    )
    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    if cfg.qk_layernorm:
        _refuse(
            bool(cfg.moe_shared_expert_ffn_hidden_size),
            f"model.moe_shared_expert_ffn_hidden_size={cfg.moe_shared_expert_ffn_hidden_size} with "
            "model.qk_layernorm=true: OLMoE has no shared expert",
        )
        _refuse(bool(dense), f"model.moe_layer_freq={cfg.moe_layer_freq}: OLMoE has an MoE layer in every layer")
        _refuse(cfg.add_qkv_bias, "model.add_qkv_bias=true: OLMoE has no attention biases")
        return "olmoe"
    if cfg.moe_shared_expert_ffn_hidden_size:
        _refuse(
            not cfg.moe_shared_expert_gate,
            f"model.moe_shared_expert_ffn_hidden_size={cfg.moe_shared_expert_ffn_hidden_size} with "
            "model.moe_shared_expert_gate=false: Qwen2-MoE's shared expert has a sigmoid gate, and no other family "
            "here has a shared expert",
        )
        return "qwen2_moe"
    _refuse(
        cfg.moe_shared_expert_gate,
        "model.moe_shared_expert_gate=true without model.moe_shared_expert_ffn_hidden_size: a gate with no shared expert",
    )
    _refuse(
        cfg.moe_router_pre_softmax,
        "model.moe_router_pre_softmax=true without a shared expert or model.qk_layernorm: Mixtral renormalises "
        "(false), Qwen2-MoE has a gated shared expert, OLMoE a q/k norm",
    )
    _refuse(
        bool(dense),
        f"model.moe_layer_freq={cfg.moe_layer_freq}: Mixtral has an MoE layer in every layer (dense layers "
        f"{dense} need Qwen2-MoE's mlp_only_layers, which comes with a gated shared expert)",
    )
    _refuse(cfg.add_qkv_bias, "model.add_qkv_bias=true: Mixtral has no attention biases (Qwen2-MoE has)")
    return "mixtral"


def moe_hf_config(cfg: ModelConfig, llama: dict[str, object]) -> dict[str, object]:
    """config.json of an MoE model: Llama's (`llama`, hf_mapping.hf_config's) with the family's router keys.
    The auxiliary loss's coefficient is written; its kind (Switch or sequence-level) and the z-loss are
    training settings transformers has no key for."""
    family = moe_family(cfg)
    common = {key: value for key, value in llama.items() if key not in ("attention_bias", "mlp_bias")}
    common.update(
        architectures=[MOE_ARCHITECTURES[family]],
        model_type=family,
        num_experts_per_tok=cfg.moe_router_topk,
        router_aux_loss_coef=cfg.moe_aux_loss_coeff,
        output_router_logits=False,
    )
    if family == "olmoe":
        return {
            **common,
            "intermediate_size": cfg.moe_ffn_size,
            "num_experts": cfg.num_experts,
            "norm_topk_prob": not cfg.moe_router_pre_softmax,
            "clip_qkv": None,
            "attention_bias": False,
        }
    if family == "mixtral":
        return {
            **common,
            "intermediate_size": cfg.moe_ffn_size,
            "num_local_experts": cfg.num_experts,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
        }
    return {
        **common,
        "intermediate_size": cfg.ffn_size,  # the dense layers' MLP (mlp_only_layers)
        "moe_intermediate_size": cfg.moe_ffn_size,
        "shared_expert_intermediate_size": cfg.moe_shared_expert_ffn_hidden_size,
        "num_experts": cfg.num_experts,
        "norm_topk_prob": not cfg.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)],
        "qkv_bias": cfg.add_qkv_bias,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * cfg.num_layers,
    }


def moe_model_config(config: HFSettings, llama: ModelConfig) -> ModelConfig:
    """Our model section for a Mixtral or Qwen2-MoE config.json: `llama` (its attention, norms and rope read
    as Llama's) with the MoE keys; what our layer cannot compute is refused naming the config.json key."""
    family = config.get("model_type")
    source = config.source
    routing = dict(
        moe_router_topk=config.size("num_experts_per_tok"),
        moe_aux_loss_coeff=config.number("router_aux_loss_coef", _DEFAULT_AUX_LOSS_COEF),
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss",
    )
    if family == "mixtral":
        jitter = config.number("router_jitter_noise", 0.0)
        _refuse(jitter != 0, f"{source}: router_jitter_noise={jitter} (noise on the router's input) is not supported")
        window = config.get("sliding_window")
        _refuse(
            window is not None and window < llama.max_positions,
            f"{source}: sliding_window={window} below max_position_embeddings={llama.max_positions}: sliding-window "
            "attention is not supported",
        )
        return replace(
            llama,
            num_experts=config.size("num_local_experts"),
            moe_ffn_hidden_size=llama.ffn_size,
            moe_router_pre_softmax=False,
            **routing,  # type: ignore[arg-type]  # the values' types are the keys' own
        )
    if family == "olmoe":
        clip = config.get("clip_qkv")
        _refuse(clip is not None, f"{source}: clip_qkv={clip} (clamping q, k, v) is not supported")
        return replace(
            llama,
            num_experts=config.size("num_experts"),
            moe_ffn_hidden_size=llama.ffn_size,
            moe_router_pre_softmax=not config.flag("norm_topk_prob", False),
            qk_layernorm=True,
            **routing,  # type: ignore[arg-type]
        )
    _refuse(
        config.flag("use_sliding_window", False),
        f"{source}: use_sliding_window=true (sliding-window attention) is not supported",
    )
    step = config.size("decoder_sparse_step", default=1)
    dense = config.get("mlp_only_layers") or []
    _refuse(
        not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense),
        f"{source}: mlp_only_layers={dense!r} is not a list of layer numbers",
    )
    freq = [0 if i in dense or (i + 1) % step else 1 for i in range(llama.num_layers)]
    return replace(
        llama,
        num_experts=config.size("num_experts"),
        moe_layer_freq=1 if all(freq) else freq,
        moe_ffn_hidden_size=config.size("moe_intermediate_size"),
        moe_shared_expert_ffn_hidden_size=config.size("shared_expert_intermediate_size"),
        moe_shared_expert_gate=True,
        add_qkv_bias=config.flag("qkv_bias", True),  # transformers' default: Qwen2's biases on q, k, v
        moe_router_pre_softmax=not config.flag("norm_topk_prob", False),
        **routing,  # type: ignore[arg-type]
    )


def _layer_prefix(family: str, i: int) -> tuple[str, tuple[str, str, str]]:
    """(transformers' prefix of layer i's MoE tensors, the expert projections' names: gate, up, down)."""
    if family == "mixtral":
        return f"model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2")
    return f"model.layers.{i}.mlp.", ("gate_proj", "up_proj", "down_proj")


def export_moe_layer(family: str, cfg: ModelConfig, ours: Tensors, i: int) -> Tensors:
    """transformers' tensors of MoE layer i from our global state dict."""
    ours_prefix = f"layers.{i}.mlp."
    prefix, (gate_name, up_name, down_name) = _layer_prefix(family, i)
    hf = {prefix + "gate.weight": ours[ours_prefix + "router.weight"]}
    if cfg.qk_layernorm:
        for norm in ("q_norm", "k_norm"):
            hf[f"model.layers.{i}.self_attn.{norm}.weight"] = ours[f"layers.{i}.attention.{norm}.weight"]
    fc1, fc2 = ours[ours_prefix + "experts.fc1_weight"], ours[ours_prefix + "experts.fc2_weight"]
    for expert in range(fc1.shape[0]):
        gate, up = fc1[expert].chunk(2, dim=0)  # SwiGLU [gate; up]
        hf[f"{prefix}experts.{expert}.{gate_name}.weight"] = gate
        hf[f"{prefix}experts.{expert}.{up_name}.weight"] = up
        hf[f"{prefix}experts.{expert}.{down_name}.weight"] = fc2[expert]
    if cfg.moe_shared_expert_ffn_hidden_size:
        shared = ours_prefix + "shared_experts."
        gate, up = ours[shared + "fc1.weight"].chunk(2, dim=0)
        hf[prefix + "shared_expert.gate_proj.weight"], hf[prefix + "shared_expert.up_proj.weight"] = gate, up
        hf[prefix + "shared_expert.down_proj.weight"] = ours[shared + "fc2.weight"]
        hf[prefix + "shared_expert_gate.weight"] = ours[shared + "gate_weight"]
    return hf


def import_moe_layer(family: str, cfg: ModelConfig, take: Callable[[str], torch.Tensor], i: int) -> Tensors:
    """Our tensors of MoE layer i; `take(name)` gives transformers' tensor (and refuses a missing one)."""
    ours_prefix = f"layers.{i}.mlp."
    prefix, (gate_name, up_name, down_name) = _layer_prefix(family, i)
    experts = range(cfg.num_experts or 0)
    ours = {ours_prefix + "router.weight": take(prefix + "gate.weight")}
    if cfg.qk_layernorm:
        for norm in ("q_norm", "k_norm"):
            ours[f"layers.{i}.attention.{norm}.weight"] = take(f"model.layers.{i}.self_attn.{norm}.weight")
    ours[ours_prefix + "experts.fc1_weight"] = torch.stack(
        [
            torch.cat([take(f"{prefix}experts.{e}.{gate_name}.weight"), take(f"{prefix}experts.{e}.{up_name}.weight")])
            for e in experts
        ]
    )
    ours[ours_prefix + "experts.fc2_weight"] = torch.stack(
        [take(f"{prefix}experts.{e}.{down_name}.weight") for e in experts]
    )
    if cfg.moe_shared_expert_ffn_hidden_size:
        shared = ours_prefix + "shared_experts."
        gate, up = take(prefix + "shared_expert.gate_proj.weight"), take(prefix + "shared_expert.up_proj.weight")
        ours[shared + "fc1.weight"] = torch.cat([gate, up])
        ours[shared + "fc2.weight"] = take(prefix + "shared_expert.down_proj.weight")
        ours[shared + "gate_weight"] = take(prefix + "shared_expert_gate.weight")
    return ours


def per_expert_tensors(family: str, cfg: ModelConfig, hf: Tensors) -> Tensors:
    """`hf` with transformers' in-memory fused experts (a model's state_dict()) split into the per-expert
    tensors save_pretrained writes, and Mixtral's router renamed to its saved name; other tensors unchanged."""
    out = dict(hf)
    for i in range(cfg.num_layers):
        fused = f"model.layers.{i}.mlp.experts.gate_up_proj"
        if fused not in out:
            continue
        prefix, (gate_name, up_name, down_name) = _layer_prefix(family, i)
        gate_up, down = out.pop(fused), out.pop(f"model.layers.{i}.mlp.experts.down_proj", None)
        if down is None:
            raise UnsupportedModelError(
                f"transformers tensor {fused} comes without model.layers.{i}.mlp.experts.down_proj"
            )
        for expert in range(gate_up.shape[0]):
            gate, up = gate_up[expert].chunk(2, dim=0)  # transformers' fused [gate; up], as ours
            out[f"{prefix}experts.{expert}.{gate_name}.weight"] = gate
            out[f"{prefix}experts.{expert}.{up_name}.weight"] = up
            out[f"{prefix}experts.{expert}.{down_name}.weight"] = down[expert]
        router = f"model.layers.{i}.mlp.gate.weight"
        if router in out and prefix + "gate.weight" != router:
            out[prefix + "gate.weight"] = out.pop(router)
    return out
