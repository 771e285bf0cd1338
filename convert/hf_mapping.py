"""Exact mappings between our global state dict and transformers' GPT2LMHeadModel / LlamaForCausalLM, and
the Llama-style MoE families MixtralForCausalLM / Qwen2MoeForCausalLM (their MoE layers: convert/hf_moe.py).

Our global state dict is a single-process GPTModel's (`layers.5.mlp.fc1.weight`, vocabulary rows padded to
ModelConfig.padded_vocab_size(1)). The layouts that differ:

    qkv          ours: per query group [q x heads_per_group, k, v] rows ([g, hpg + 2, d, h]);
                 GPT-2: c_attn = [q; k; v] over all heads, as Conv1D (weight stored [in, out]);
                 Llama: q_proj [n * d, h], k_proj / v_proj [g * d, h] (query head i uses kv head i // hpg)
    mlp.fc1      ours: SwiGLU [gate; up] stacked along rows -> Llama gate_proj, up_proj
    Conv1D       GPT-2's c_attn, c_proj, c_fc weights are the transpose of our Linear weights
    vocabulary   padded rows dropped on export and added (zeros) on import (the tables' Sharding valid rows)
Pure tensors and dicts: the files (config.json, safetensors, tokenizer) are written by convert/hf_folder.py.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from convert.hf_moe import (
    MOE_ARCHITECTURES,
    export_moe_layer,
    import_moe_layer,
    moe_family,
    moe_hf_config,
    moe_model_config,
    per_expert_tensors,
)
from convert.hf_settings import HFSettings, UnsupportedModelError
from model.config import ModelConfig
from parallel.tensor_parallel import param_shardings

Tensors = dict[str, torch.Tensor]


# GPT-2's activation_function values -> our model.activation: exact erf GeLU, or the tanh form (gelu_new is
# GPT-2's default; gelu_pytorch_tanh computes the same function with F.gelu(approximate="tanh")).
GELU_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
HF_GELU = {"gelu": "gelu", "gelu_tanh": "gelu_new"}


# ---- architecture ----------------------------------------------------------------------------------
def hf_architecture(cfg: ModelConfig) -> str:
    """'gpt2' (learned positions, LayerNorm, GeLU) or 'llama' (rope, RMSNorm, SwiGLU), or for an MoE model
    'mixtral' or 'qwen2_moe' (Llama's attention and norms; convert/hf_moe.moe_family); else refuse."""
    if cfg.num_experts:
        return moe_family(cfg)
    if cfg.qk_layernorm:
        raise UnsupportedModelError("model.qk_layernorm=true: GPT-2 and Llama have no q/k norm (OLMoE, an MoE, has)")
    if cfg.add_qkv_bias and not cfg.add_bias_linear:
        raise UnsupportedModelError(
            "model.add_qkv_bias=true with model.add_bias_linear=false: GPT-2 and Llama have no biases on q, k, v "
            "alone (Llama's attention_bias covers o_proj too)"
        )
    style = (cfg.position_embedding_type, cfg.normalization, cfg.activation)
    if style in (("learned", "layernorm", "gelu"), ("learned", "layernorm", "gelu_tanh")):
        if cfg.query_groups != cfg.num_attention_heads:
            raise UnsupportedModelError(
                f"model.num_query_groups={cfg.num_query_groups}: GPT-2 has no grouped-query attention"
            )
        return "gpt2"
    if style == ("rope", "rmsnorm", "swiglu"):
        return "llama"
    raise UnsupportedModelError(
        f"model style position_embedding_type={cfg.position_embedding_type}, normalization={cfg.normalization}, "
        f"activation={cfg.activation} has no transformers equivalent (GPT-2: learned/layernorm/gelu or gelu_tanh, "
        "Llama: rope/rmsnorm/swiglu)"
    )


def hf_config(cfg: ModelConfig, bos_id: int, eos_id: int) -> dict[str, object]:
    """config.json content for our model (vocab_size unpadded)."""
    common = {
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "tie_word_embeddings": cfg.tie_embeddings,
        "use_cache": True,
    }
    if hf_architecture(cfg) == "gpt2":
        return {
            **common,
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_positions": cfg.max_positions,
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads,
            "n_inner": cfg.ffn_size,
            "activation_function": HF_GELU[cfg.activation],  # the GeLU it trained with
            "resid_pdrop": cfg.hidden_dropout,
            "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout,
            "layer_norm_epsilon": cfg.norm_epsilon,
            "scale_attn_weights": True,
        }
    llama: dict[str, object] = {
        **common,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.norm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
        "attention_bias": cfg.add_bias_linear,
        "mlp_bias": cfg.add_bias_linear,
        "attention_dropout": cfg.attention_dropout,
    }
    return llama if not cfg.num_experts else moe_hf_config(cfg, llama)


def _refuse(condition: bool, option: str) -> None:
    if condition:
        raise UnsupportedModelError(f"transformers option {option} is not supported by this model")


def model_config_from_hf(config: Mapping[str, object], source: str = "config.json") -> ModelConfig:
    """Our model section for a transformers config.json (GPT-2, Llama, Mixtral or Qwen2-MoE), checked as the
    trainer checks its model section; unsupported options and malformed values refused naming `source` and the
    key."""
    model_type = config.get("model_type")
    if model_type == "gpt2":
        cfg = _gpt2_model_config(HFSettings(config, source))
    elif model_type == "llama":
        cfg = _llama_model_config(HFSettings(config, source))
    elif model_type in MOE_ARCHITECTURES:
        settings = HFSettings(config, source)
        cfg = moe_model_config(settings, _llama_model_config(settings))
    else:
        raise UnsupportedModelError(
            f"model_type={model_type!r} (architectures {config.get('architectures')}) is not supported: only gpt2, "
            f"llama, {', '.join(MOE_ARCHITECTURES)}"
        )
    try:
        cfg.validate()
    except ValueError as err:
        raise UnsupportedModelError(f"{source} describes a model the trainer refuses: {err}") from None
    return cfg


def _gpt2_model_config(config: HFSettings) -> ModelConfig:
    act = config.get("activation_function", "gelu_new")
    _refuse(act not in GELU_FROM_HF, f"activation_function={act!r} (only {', '.join(GELU_FROM_HF)})")
    _refuse(not config.get("scale_attn_weights", True), "scale_attn_weights=false")
    _refuse(config.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx=true")
    _refuse(config.get("add_cross_attention", False), "add_cross_attention=true")
    hidden = config.size("n_embd")
    return ModelConfig(
        num_layers=config.size("n_layer"),
        hidden_size=hidden,
        num_attention_heads=config.size("n_head"),
        ffn_hidden_size=config.size("n_inner", optional=True) or 4 * hidden,
        seq_length=config.size("n_positions"),
        vocab_size=config.size("vocab_size"),
        make_vocab_size_divisible_by=128,
        position_embedding_type="learned",
        normalization="layernorm",
        norm_epsilon=config.number("layer_norm_epsilon", 1e-5),
        activation=GELU_FROM_HF[act],
        tie_embeddings=config.flag("tie_word_embeddings", True),
        add_bias_linear=True,
        hidden_dropout=config.number("resid_pdrop", 0.1),
        attention_dropout=config.number("attn_pdrop", 0.1),
        init_std=config.number("initializer_range", 0.02),
    )


def _llama_model_config(config: HFSettings) -> ModelConfig:
    act = config.get("hidden_act", "silu")
    _refuse(act != "silu", f"hidden_act={act!r} (only 'silu', SwiGLU)")
    attention_bias, mlp_bias = config.flag("attention_bias", False), config.flag("mlp_bias", False)
    _refuse(
        attention_bias != mlp_bias,
        f"attention_bias={attention_bias} with mlp_bias={mlp_bias} (one bias switch for every linear layer)",
    )
    _refuse(config.get("pretraining_tp", 1) != 1, f"pretraining_tp={config.get('pretraining_tp')}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    _refuse(not isinstance(rope, dict), f"rope_parameters={rope!r} (a section of rope settings expected)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _refuse(rope_type != "default", f"rope_type={rope_type!r} (only 'default' rotary)")
    theta = HFSettings(rope, config.source).number("rope_theta", config.number("rope_theta", 10000.0))
    hidden, heads = config.size("hidden_size"), config.size("num_attention_heads")
    head_dim = config.size("head_dim", optional=True) or hidden // heads
    _refuse(
        head_dim * heads != hidden,
        f"head_dim={head_dim} with hidden_size={hidden}, "
        f"num_attention_heads={heads} (head_dim must be hidden_size / num_attention_heads)",
    )
    return ModelConfig(
        num_layers=config.size("num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=config.size("num_key_value_heads", optional=True) or heads,
        ffn_hidden_size=config.size("intermediate_size"),
        seq_length=config.size("max_position_embeddings"),
        vocab_size=config.size("vocab_size"),
        make_vocab_size_divisible_by=128,
        position_embedding_type="rope",
        rotary_base=theta,
        normalization="rmsnorm",
        norm_epsilon=config.number("rms_norm_eps", 1e-6),
        activation="swiglu",
        tie_embeddings=config.flag("tie_word_embeddings", False),
        add_bias_linear=attention_bias,
        hidden_dropout=0.0,
        attention_dropout=config.number("attention_dropout", 0.0),
        init_std=config.number("initializer_range", 0.02),
    )


# ---- tensors ---------------------------------------------------------------------------------------
def split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our per-group qkv rows [g * (hpg + 2) * d, ...] -> q [n * d, ...], k [g * d, ...], v [g * d, ...]."""
    groups, d = cfg.query_groups, cfg.head_dim
    hpg = cfg.num_attention_heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, hpg + 2, d, *rest)
    return (
        grouped[:, :hpg].reshape(groups * hpg * d, *rest),
        grouped[:, hpg].reshape(groups * d, *rest),
        grouped[:, hpg + 1].reshape(groups * d, *rest),
    )


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Inverse of split_qkv."""
    groups, d = cfg.query_groups, cfg.head_dim
    hpg = cfg.num_attention_heads // groups
    rest = q.shape[1:]
    parts = (q.reshape(groups, hpg, d, *rest), k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest))
    return torch.cat(parts, dim=1).reshape(groups * (hpg + 2) * d, *rest).contiguous()


def layer_names(arch: str, i: int) -> dict[str, str]:
    """Our layer-i parameter name -> transformers' (for tensors that map one to one, up to a transpose)."""
    # Two name tables of the same shape, GPT-2's and Llama's: a deliberate twin (data, not logic).
    if arch == "gpt2":
        p, q = f"layers.{i}.", f"transformer.h.{i}."
        return {
            p + "input_norm.weight": q + "ln_1.weight",
            p + "input_norm.bias": q + "ln_1.bias",
            p + "post_attention_norm.weight": q + "ln_2.weight",
            p + "post_attention_norm.bias": q + "ln_2.bias",
            p + "attention.proj.weight": q + "attn.c_proj.weight",
            p + "attention.proj.bias": q + "attn.c_proj.bias",
            p + "mlp.fc1.weight": q + "mlp.c_fc.weight",
            p + "mlp.fc1.bias": q + "mlp.c_fc.bias",
            p + "mlp.fc2.weight": q + "mlp.c_proj.weight",
            p + "mlp.fc2.bias": q + "mlp.c_proj.bias",
        }
    p, q = f"layers.{i}.", f"model.layers.{i}."
    return {
        p + "input_norm.weight": q + "input_layernorm.weight",
        p + "post_attention_norm.weight": q + "post_attention_layernorm.weight",
        p + "attention.proj.weight": q + "self_attn.o_proj.weight",
        p + "attention.proj.bias": q + "self_attn.o_proj.bias",
        p + "mlp.fc2.weight": q + "mlp.down_proj.weight",
        p + "mlp.fc2.bias": q + "mlp.down_proj.bias",
    }


def global_names(arch: str) -> dict[str, str]:
    """Non-layer names: ours -> transformers'."""
    if arch == "gpt2":
        return {
            "embedding.word_embeddings.weight": "transformer.wte.weight",
            "embedding.position_embeddings.weight": "transformer.wpe.weight",
            "final_norm.weight": "transformer.ln_f.weight",
            "final_norm.bias": "transformer.ln_f.bias",
            "output_layer.weight": "lm_head.weight",
        }
    return {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "final_norm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }


def _is_conv1d(arch: str, hf_name: str) -> bool:
    """GPT-2's Conv1D weights (every 2-D layer weight but the embeddings) are stored [in, out]."""
    return arch == "gpt2" and hf_name.endswith(".weight") and ".h." in hf_name and "ln_" not in hf_name


def _qkv_targets(arch: str, i: int) -> tuple[str, ...]:
    if arch == "gpt2":
        return (f"transformer.h.{i}.attn.c_attn",)
    return tuple(f"model.layers.{i}.self_attn.{x}_proj" for x in "qkv")


def to_hf_state_dict(cfg: ModelConfig, ours: Tensors) -> Tensors:
    """Our global state dict -> transformers' (padded vocabulary rows dropped; GPT-2 without biases gets
    zero biases, which computes the same; a tied output layer is left to transformers' tying)."""
    arch = hf_architecture(cfg)
    shardings = param_shardings(cfg)
    hf: Tensors = {}
    for i in range(cfg.num_layers):
        for our, theirs in layer_names(arch, i).items():
            if our in ours:
                hf[theirs] = ours[our]
        for kind in ("weight", "bias"):
            if f"layers.{i}.attention.qkv.{kind}" in ours:
                _export_qkv(arch, cfg, ours[f"layers.{i}.attention.qkv.{kind}"], kind, i, hf)
            if arch != "gpt2" and f"layers.{i}.mlp.fc1.{kind}" in ours:
                gate, up = ours[f"layers.{i}.mlp.fc1.{kind}"].chunk(2, dim=0)  # SwiGLU [gate; up]
                hf[f"model.layers.{i}.mlp.gate_proj.{kind}"], hf[f"model.layers.{i}.mlp.up_proj.{kind}"] = gate, up
        if cfg.is_moe_layer(i):
            hf.update(export_moe_layer(arch, cfg, ours, i))
    for our, theirs in global_names(arch).items():
        if our == "output_layer.weight" and cfg.tie_embeddings:
            continue
        hf[theirs] = shardings[our].stored(ours[our])
    if arch == "gpt2":
        hf = {name: (t.t() if _is_conv1d(arch, name) else t) for name, t in hf.items()}
        if not cfg.add_bias_linear:
            hf.update(_zero_gpt2_biases(cfg, hf))
    return {name: t.contiguous() for name, t in hf.items()}


def _export_qkv(arch: str, cfg: ModelConfig, tensor: torch.Tensor, kind: str, i: int, hf: Tensors) -> None:
    q, k, v = split_qkv(tensor, cfg)
    targets = _qkv_targets(arch, i)
    if arch == "gpt2":
        hf[f"{targets[0]}.{kind}"] = torch.cat([q, k, v], dim=0)
    else:
        for target, part in zip(targets, (q, k, v)):
            hf[f"{target}.{kind}"] = part


def _zero_gpt2_biases(cfg: ModelConfig, hf: Tensors) -> Tensors:
    h = cfg.hidden_size
    zeros: Tensors = {}
    dtype = hf["transformer.wte.weight"].dtype
    for i in range(cfg.num_layers):
        p = f"transformer.h.{i}."
        for name, size in (("attn.c_attn", 3 * h), ("attn.c_proj", h), ("mlp.c_fc", cfg.ffn_size), ("mlp.c_proj", h)):
            zeros[f"{p}{name}.bias"] = torch.zeros(size, dtype=dtype)
    return zeros


def from_hf_state_dict(cfg: ModelConfig, hf: Tensors) -> Tensors:
    """transformers' state dict -> our global state dict (vocabulary padded with zero rows to
    cfg.padded_vocab_size(1)). A transformers tensor with no counterpart here is refused by name."""
    arch = hf_architecture(cfg)
    hf = {name: (t.t() if _is_conv1d(arch, name) else t) for name, t in hf.items()}
    if cfg.num_experts:
        hf = per_expert_tensors(arch, cfg, hf)
    used: set[str] = set()

    def take(name: str, missing: str | None = None) -> torch.Tensor:
        """hf[name], marked used; `missing`: why it matters when absent (default: a layer's tensor)."""
        if name not in hf:
            why = missing or f"the weights hold less than the config's {cfg.num_layers} layers describe"
            raise UnsupportedModelError(f"transformers tensor {name} is missing: {why}")
        used.add(name)
        return hf[name]

    ours: Tensors = {}
    bias_kinds = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    qkv_kinds = ("weight", "bias") if cfg.qkv_bias else ("weight",)  # Qwen2-MoE: q, k, v biases alone
    for i in range(cfg.num_layers):
        moe_layer = cfg.is_moe_layer(i)
        for our, theirs in layer_names(arch, i).items():
            if our.endswith(".bias") and "norm" not in our and not cfg.add_bias_linear:
                continue
            if moe_layer and our.startswith(f"layers.{i}.mlp."):
                continue  # the MoE layer's tensors: import_moe_layer
            ours[our] = take(theirs)
        for kind in qkv_kinds:
            targets = _qkv_targets(arch, i)
            if arch == "gpt2":
                q, k, v = take(f"{targets[0]}.{kind}").chunk(3, dim=0)
            else:
                q, k, v = (take(f"{t}.{kind}") for t in targets)
            ours[f"layers.{i}.attention.qkv.{kind}"] = merge_qkv(q, k, v, cfg)
        for kind in bias_kinds:
            if arch != "gpt2" and not moe_layer:
                gate = take(f"model.layers.{i}.mlp.gate_proj.{kind}")
                ours[f"layers.{i}.mlp.fc1.{kind}"] = torch.cat([gate, take(f"model.layers.{i}.mlp.up_proj.{kind}")])
        if moe_layer:
            ours.update(import_moe_layer(arch, cfg, take, i))
    padded, shardings = cfg.padded_vocab_size(1), param_shardings(cfg)
    for our, theirs in global_names(arch).items():
        if our == "output_layer.weight" and cfg.tie_embeddings:
            used.add(theirs)  # transformers may store the tied copy; ours is the embedding itself
            if theirs in hf and not torch.equal(
                hf[theirs], ours["embedding.word_embeddings.weight"][: len(hf[theirs])]
            ):
                raise UnsupportedModelError(
                    f"tie_word_embeddings is true but the weights hold a {theirs} of their own (not the embedding): "
                    "the config does not belong to these weights"
                )
            continue
        missing = (
            "config.json says tie_word_embeddings=false (an output layer of its own) but the weights hold none; "
            "set tie_word_embeddings=true if the model reuses its embedding, or use the weights saved with it"
            if our == "output_layer.weight"
            else "the weights lack a tensor every model of this architecture has (an incomplete export?)"
        )
        ours[our] = shardings[our].padded(take(theirs, missing), padded)
    if cfg.tie_embeddings:
        ours["output_layer.weight"] = ours["embedding.word_embeddings.weight"]
    left = sorted(set(hf) - used - {n for n in hf if n.endswith((".attn.bias", ".attn.masked_bias"))})
    if left:
        raise UnsupportedModelError(
            f"transformers tensor {left[0]} has no counterpart in this model ({len(left)} such tensors): the "
            f"weights hold more than the config's {cfg.num_layers} layers, or parts this project does not convert"
        )
    return {name: t.contiguous() for name, t in ours.items()}
