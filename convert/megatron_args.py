"""Megatron-LM's `args` and our config, one mapping for both directions: convert/megatron.py reads a model
section (and the tokenizer keys of a data section) from a checkpoint's args, convert/megatron_export.py writes
the args Megatron-LM reads the model from (`--use-checkpoint-args`) and checks on load.

`MODEL_ARGS` holds one `ArgRule` per ModelConfig field: the args that carry it, as export writes them, and how
the reader gets the field back (Megatron-LM's default where older args lack the name). `FIXED` are Megatron
options this model has one value of: export writes it, the reader refuses another. `TOKENIZERS` names our
tokenizer types in Megatron's spelling.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from convert.hf_folder import hf_tokenizer_json
from convert.hf_mapping import UnsupportedModelError
from data.tokenizers import build_tokenizer
from model.config import ModelConfig

Args = argparse.Namespace
REQUIRED = object()  # an arg every supported checkpoint has (checked by convert/megatron_checks.check_args)


@dataclass(frozen=True)
class ArgRule:
    """One field of ModelConfig and Megatron-LM's args for it: `write(cfg)` gives the args export writes,
    `read(args)` the field's value from a checkpoint's args. Without a field (None) the args only describe
    the model (derived or fixed values), and nothing is read back."""

    field: str | None
    write: Callable[[ModelConfig], dict[str, object]]
    read: Callable[[Args], Any] | None = None  # any value of Megatron's args


def _arg(args: Args, name: str, default: Any = None) -> Any:
    return getattr(args, name) if default is REQUIRED else getattr(args, name, default)


def same(field: str, arg: str | None = None, default: object = REQUIRED, written: str | None = None) -> ArgRule:
    """A value Megatron keeps as it is, under `arg` (default: the field's name); `default` is Megatron's
    assumption when the args lack it; export writes the resolved property `written` when the field may be
    None (ffn_size for ffn_hidden_size, ...)."""
    name = arg or field
    return ArgRule(field, lambda cfg: {name: getattr(cfg, written or field)}, lambda args: _arg(args, name, default))


def choice(field: str, arg: str, values: dict[str, str], default: str) -> ArgRule:
    """An enumeration: our value -> Megatron's (`default`, Megatron's own, when the args lack it)."""
    ours = {theirs: mine for mine, theirs in values.items()}
    return ArgRule(
        field, lambda cfg: {arg: values[getattr(cfg, field)]}, lambda args: ours.get(_arg(args, arg), ours[default])
    )


def _activation(args: Args) -> str:
    """swiglu, GPT-2's tanh GeLU (openai_gelu), or the exact erf GeLU (Megatron's default)."""
    if _arg(args, "swiglu", False):
        return "swiglu"
    return "gelu_tanh" if _arg(args, "openai_gelu", False) else "gelu"


def _rotary_base(cfg: ModelConfig) -> float | int:
    return int(cfg.rotary_base) if float(cfg.rotary_base).is_integer() else cfg.rotary_base


# Megatron options this model has one value of: export writes it, the reader refuses another (None in older
# args: the same).
FIXED = {"rotary_percent": 1.0, "rotary_interleaved": False, "apply_layernorm_1p": False, "squared_relu": False}


def fixed(*names: str) -> ArgRule:
    """Options of FIXED, written where Megatron's args list them."""
    return ArgRule(None, lambda cfg: {name: FIXED[name] for name in names})


MODEL_ARGS: tuple[ArgRule, ...] = (
    same("num_layers"),
    same("hidden_size"),
    same("ffn_hidden_size", default=None, written="ffn_size"),
    same("num_attention_heads"),
    ArgRule(
        "num_query_groups",
        lambda cfg: {
            "group_query_attention": cfg.query_groups != cfg.num_attention_heads,
            "num_query_groups": cfg.query_groups,
        },
        lambda args: args.num_query_groups if _arg(args, "group_query_attention", False) else None,
    ),
    ArgRule(None, lambda cfg: {"kv_channels": cfg.head_dim}),  # the reader refuses any other
    same("seq_length"),
    same("max_position_embeddings", default=None, written="max_positions"),
    ArgRule(
        "position_embedding_type",
        lambda cfg: {
            "position_embedding_type": "rope" if cfg.position_embedding_type == "rope" else "learned_absolute",
            "add_position_embedding": cfg.position_embedding_type != "rope",
            "use_rotary_position_embeddings": cfg.position_embedding_type == "rope",
        },
        lambda args: "rope" if _arg(args, "position_embedding_type") == "rope" else "learned",
    ),
    ArgRule(
        "rotary_base", lambda cfg: {"rotary_base": _rotary_base(cfg)}, lambda a: float(_arg(a, "rotary_base", 10000))
    ),
    fixed("rotary_percent", "rotary_interleaved"),
    choice("normalization", "normalization", {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}, "LayerNorm"),
    ArgRule(
        "norm_epsilon",
        lambda cfg: {"norm_epsilon": cfg.norm_epsilon},
        lambda args: _arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5)),
    ),
    fixed("apply_layernorm_1p"),
    ArgRule(
        "activation",
        lambda cfg: {"swiglu": cfg.activation == "swiglu", "openai_gelu": cfg.activation == "gelu_tanh"},
        _activation,
    ),
    fixed("squared_relu"),
    ArgRule(
        "add_bias_linear",
        lambda cfg: {"add_bias_linear": cfg.add_bias_linear, "add_qkv_bias": cfg.qkv_bias},
        lambda args: _arg(args, "add_bias_linear", True),
    ),
    ArgRule(
        "add_qkv_bias",
        lambda cfg: {},  # written with add_bias_linear above
        lambda args: bool(_arg(args, "add_qkv_bias", False)) and not _arg(args, "add_bias_linear", True),
    ),
    ArgRule(
        "tie_embeddings",
        lambda cfg: {"untie_embeddings_and_output_weights": not cfg.tie_embeddings},
        lambda args: not _arg(args, "untie_embeddings_and_output_weights", False),
    ),
    same("hidden_dropout", default=0.1),
    same("attention_dropout", default=0.1),
    same("init_std", "init_method_std", default=0.02),
    same("make_vocab_size_divisible_by", default=128),
)
# Megatron options this model does not have, refused when set: name -> is the value unsupported?
UNSUPPORTED: dict[str, Callable[[object], bool]] = {
    "num_experts": lambda v: v not in (None, 0),
    "apply_residual_connection_post_layernorm": bool,
    "qk_layernorm": bool,
    "layernorm_zero_centered_gamma": bool,
    "multi_latent_attention": bool,
    "position_embedding_type": lambda v: v not in (None, "learned_absolute", "rope"),
    "normalization": lambda v: v not in (None, "LayerNorm", "RMSNorm"),
}
# Our tokenizer types -> Megatron's names: the first is what export writes, every one is read.
TOKENIZERS = {
    "GPT2BPETokenizer": ("GPT2BPETokenizer",),
    "SentencePieceTokenizer": ("GPTSentencePieceTokenizer", "SentencePieceTokenizer"),
    "HuggingFaceTokenizer": ("HuggingFaceTokenizer",),
}


def model_args(cfg: ModelConfig) -> dict[str, object]:
    """The model fields of Megatron-LM's args for `cfg` (export), in MODEL_ARGS order."""
    if cfg.qk_layernorm:
        # megatron-core's qk_layernorm normalises each head on its own; ours spans every head (OLMoE's)
        raise UnsupportedModelError("model.qk_layernorm=true has no Megatron-LM counterpart (its norm is per head)")
    return {name: value for rule in MODEL_ARGS for name, value in rule.write(cfg).items()}


def refuse_unsupported(args: Args) -> None:
    """Megatron options this model does not have (or has another value of), refused by name."""
    for name, fixed in FIXED.items():
        value = _arg(args, name)
        if value is not None and value != fixed:
            raise UnsupportedModelError(f"Megatron option {name}={value!r} is not supported by this model")
    for name, bad in UNSUPPORTED.items():
        value = _arg(args, name)
        if value is not None and bad(value):
            raise UnsupportedModelError(f"Megatron option {name}={value!r} is not supported by this model")
    hidden, heads = args.hidden_size, args.num_attention_heads
    if _arg(args, "kv_channels") not in (None, hidden // heads):
        raise UnsupportedModelError(
            f"Megatron option kv_channels={args.kv_channels} is not supported "
            f"(needs hidden_size / num_attention_heads = {hidden // heads})"
        )
    add_bias = _arg(args, "add_bias_linear", True)
    if add_bias and not _arg(args, "add_qkv_bias", add_bias):
        raise UnsupportedModelError(
            f"Megatron option add_qkv_bias={args.add_qkv_bias} with add_bias_linear="
            f"{add_bias} is not supported (biases on every linear layer but q, k, v)"
        )


def model_config_from_args(args: Args, vocab_size: int) -> ModelConfig:
    """Our model section from Megatron-LM's args (import)."""
    refuse_unsupported(args)
    fields = {rule.field: rule.read(args) for rule in MODEL_ARGS if rule.field is not None and rule.read is not None}
    return ModelConfig(**fields, vocab_size=vocab_size)


def tokenizer_args(cfg: ModelConfig, data: dict) -> dict:
    """Megatron's tokenizer args for our data section (export): GPT-2 BPE, SentencePiece or HuggingFace (the
    folder holding tokenizer.json, for AutoTokenizer) with their files as absolute paths, else NullTokenizer
    over our vocabulary (its size is vocab_size + 1, so vocab_size - 1 is stored)."""
    kind = data.get("tokenizer_type")
    theirs = TOKENIZERS[kind][0] if kind in TOKENIZERS else None
    if kind == "GPT2BPETokenizer" and data.get("vocab_file") and data.get("merge_file"):
        files = {"vocab_file": os.path.abspath(data["vocab_file"]), "merge_file": os.path.abspath(data["merge_file"])}
        return {"tokenizer_type": theirs, **files, "vocab_size": None}
    if kind == "SentencePieceTokenizer" and data.get("tokenizer_model"):
        model = os.path.abspath(data["tokenizer_model"])
        return {"tokenizer_type": theirs, "tokenizer_model": model, "vocab_size": None}
    if kind == "HuggingFaceTokenizer" and data.get("tokenizer_model"):
        model = os.path.abspath(data["tokenizer_model"])
        folder = model if os.path.isdir(model) else os.path.dirname(model)
        return {"tokenizer_type": theirs, "tokenizer_model": folder, "vocab_size": None}
    return {"tokenizer_type": "NullTokenizer", "vocab_size": cfg.vocab_size - 1 if cfg.vocab_size else None}


def tokenizer_from_args(args: Args) -> tuple[dict | None, int | None]:
    """(our data-section tokenizer keys or None, the tokenizer's vocabulary size or None) of the tokenizer
    Megatron's args name (import). GPT-2 BPE, SentencePiece and HuggingFace (tokenizer_model a local folder or
    tokenizer.json) are carried when their files exist; NullTokenizer has no files (its size is
    args.vocab_size + 1: the ids and one end-of-document id, Megatron's rule)."""
    kind = _arg(args, "tokenizer_type")
    if kind == "NullTokenizer" and _arg(args, "vocab_size"):
        keys = {"tokenizer_type": kind, "vocab_file": None, "merge_file": None, "tokenizer_model": None}
        return keys, int(args.vocab_size) + 1
    files = {
        "vocab_file": _arg(args, "vocab_file"),
        "merge_file": _arg(args, "merge_file"),
        "tokenizer_model": _arg(args, "tokenizer_model"),
    }
    ours = next((mine for mine, names in TOKENIZERS.items() if kind in names), None)
    if ours == "HuggingFaceTokenizer":
        # A hub name, or a folder without tokenizer.json (a slow tokenizer): nothing this project reads.
        files = {"vocab_file": None, "merge_file": None, "tokenizer_model": hf_tokenizer_json(files["tokenizer_model"])}
    if ours is None or not any(files.values()) or not all(os.path.isfile(p) for p in files.values() if p):
        return None, None
    tokenizer = build_tokenizer(ours, **files)
    return {"tokenizer_type": ours, **files}, tokenizer.vocab_size
