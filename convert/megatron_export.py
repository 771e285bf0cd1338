"""Our global state dict -> Megatron-LM's legacy "torch" checkpoint at a chosen tp / pp / vp, with
megatron-core's key names (local layer spec: `decoder.layers.N.self_attention.linear_qkv.weight`, ...)
and the `args` Megatron-LM reads the model from (`--use-checkpoint-args`) and checks on load.

    OUT/latest_checkpointed_iteration.txt
    OUT/iter_{it:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt
        {"args", "checkpoint_version": 3.0, "iteration", "model" (or "model0".."model{vp-1}"),
         "num_floating_point_operations_so_far": 0}

Weights only: Megatron-LM continues from it with `--finetune` (or `--no-load-optim --no-load-rng`). The
vocabulary is padded by Megatron's rule (a multiple of make_vocab_size_divisible_by x tp); a tied
embedding is stored on the first stage and, as Megatron keeps it, copied to the last stage's
output_layer.weight. Every linear of the local spec carries an `_extra_state` of None (strict loading
expects the key).
"""

from __future__ import annotations

import argparse
import os

import torch

from model.config import ModelConfig
from parallel.pipeline.stages import StageMap
from parallel.tensor_parallel import param_shardings

Tensors = dict[str, torch.Tensor | None]
# Our layer-local module names -> megatron-core's (local spec).
MCORE_LAYER_NAMES = {
    "input_norm": "input_layernorm",
    "attention.qkv": "self_attention.linear_qkv",
    "attention.proj": "self_attention.linear_proj",
    "post_attention_norm": "pre_mlp_layernorm",
    "mlp.fc1": "mlp.linear_fc1",
    "mlp.fc2": "mlp.linear_fc2",
}
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def tokenizer_args(cfg: ModelConfig, data: dict) -> dict:
    """Megatron's tokenizer args for our data section: GPT-2 BPE, SentencePiece or HuggingFace (the folder
    holding tokenizer.json, for AutoTokenizer) with their files as absolute paths, else NullTokenizer over our
    vocabulary (its size is vocab_size + 1, so vocab_size - 1 is stored)."""
    kind = data.get("tokenizer_type")
    if kind == "GPT2BPETokenizer" and data.get("vocab_file") and data.get("merge_file"):
        files = {"vocab_file": os.path.abspath(data["vocab_file"]), "merge_file": os.path.abspath(data["merge_file"])}
        return {"tokenizer_type": kind, **files, "vocab_size": None}
    if kind == "SentencePieceTokenizer" and data.get("tokenizer_model"):
        model = os.path.abspath(data["tokenizer_model"])
        return {"tokenizer_type": "GPTSentencePieceTokenizer", "tokenizer_model": model, "vocab_size": None}
    if kind == "HuggingFaceTokenizer" and data.get("tokenizer_model"):
        model = os.path.abspath(data["tokenizer_model"])
        folder = model if os.path.isdir(model) else os.path.dirname(model)
        return {"tokenizer_type": kind, "tokenizer_model": folder, "vocab_size": None}
    return {"tokenizer_type": "NullTokenizer", "vocab_size": cfg.vocab_size - 1 if cfg.vocab_size else None}


def megatron_args(cfg: ModelConfig, layout: tuple[int, int, int], iteration: int, data: dict) -> argparse.Namespace:
    """The model, layout and tokenizer fields of Megatron-LM's args (what load_args_from_checkpoint and
    check_checkpoint_args read), for layout (tp, pp, vp)."""
    tp, pp, vp = layout
    rope = cfg.position_embedding_type == "rope"
    return argparse.Namespace(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_size,
        num_attention_heads=cfg.num_attention_heads,
        group_query_attention=cfg.query_groups != cfg.num_attention_heads,
        num_query_groups=cfg.query_groups,
        kv_channels=cfg.head_dim,
        seq_length=cfg.seq_length,
        max_position_embeddings=cfg.max_positions,
        position_embedding_type="rope" if rope else "learned_absolute",
        add_position_embedding=not rope,
        use_rotary_position_embeddings=rope,
        rotary_base=int(cfg.rotary_base) if float(cfg.rotary_base).is_integer() else cfg.rotary_base,
        rotary_percent=1.0,
        rotary_interleaved=False,
        normalization="RMSNorm" if cfg.normalization == "rmsnorm" else "LayerNorm",
        norm_epsilon=cfg.norm_epsilon,
        apply_layernorm_1p=False,
        swiglu=cfg.activation == "swiglu",
        openai_gelu=cfg.activation == "gelu_tanh",
        squared_relu=False,
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_bias_linear,
        untie_embeddings_and_output_weights=not cfg.tie_embeddings,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_std,
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        padded_vocab_size=cfg.padded_vocab_size(tp),
        **tokenizer_args(cfg, data),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        num_layers_per_virtual_pipeline_stage=StageMap(pp, vp).layers_per_chunk(cfg.num_layers) if vp > 1 else None,
        transformer_impl="local",
        params_dtype=torch.float32,
        iteration=iteration,
        consumed_train_samples=0,
        consumed_valid_samples=0,
    )


def chunk_state(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, rank: tuple[int, int, int], layout: tuple[int, int, int]
) -> Tensors:
    """One model chunk's state dict under megatron-core names. rank = (tp_rank, pp_rank, chunk), layout =
    (tp, pp, vp); chunk c of stage p holds layers [(c * pp + p) * per, ...) (Megatron's interleaving).
    `tensors` is our global state dict padded to Megatron's vocabulary rows at this tp."""
    (tp_rank, pp_rank, chunk), (tp, pp, vp) = rank, layout
    shardings = param_shardings(cfg)
    state: Tensors = {}

    def put(megatron_name: str, ours: str) -> None:
        if ours in tensors:
            state[megatron_name] = shardings[ours].shard(tensors[ours], tp_rank, tp).clone()

    placement = StageMap(pp, vp).placement(cfg.num_layers, pp_rank, chunk)  # Megatron's interleaving
    first, last = placement.pre_process, placement.post_process
    if first:
        put("embedding.word_embeddings.weight", "embedding.word_embeddings.weight")
        put("embedding.position_embeddings.weight", "embedding.position_embeddings.weight")
    for local, layer in enumerate(placement.layer_ids):
        for ours, theirs in MCORE_LAYER_NAMES.items():
            for kind in ("weight", "bias"):
                put(f"decoder.layers.{local}.{theirs}.{kind}", f"layers.{layer}.{ours}.{kind}")
        state.update({f"decoder.layers.{local}.{linear}._extra_state": None for linear in LINEARS})
    if last:
        put("decoder.final_layernorm.weight", "final_norm.weight")
        put("decoder.final_layernorm.bias", "final_norm.bias")
        if not (cfg.tie_embeddings and first):  # tied on one stage: the embedding is the output layer
            put(
                "output_layer.weight",
                "embedding.word_embeddings.weight" if cfg.tie_embeddings else "output_layer.weight",
            )
        state["output_layer._extra_state"] = None
    return state


def megatron_files(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, layout: tuple[int, int, int], iteration: int, data: dict
) -> dict[str, dict]:
    """{relative path of each model_optim_rng.pt: its payload} for the layout (tp, pp, vp)."""
    from convert.model_weights import check_layout, resize_vocab_rows

    tp, pp, vp = layout
    check_layout(cfg, tp, pp, vp)  # the trainer's layout rules and messages (heads, groups, ffn, layers, vp)
    padded = resize_vocab_rows(tensors, cfg, cfg.padded_vocab_size(tp))
    args = megatron_args(cfg, layout, iteration, data)
    files = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            chunks = [chunk_state(padded, cfg, (tp_rank, pp_rank, c), layout) for c in range(vp)]
            models = {"model": chunks[0]} if vp == 1 else {f"model{c}": chunk for c, chunk in enumerate(chunks)}
            folder = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
            files[os.path.join(f"iter_{iteration:07d}", folder, "model_optim_rng.pt")] = {
                "args": args,
                "checkpoint_version": 3.0,
                "iteration": iteration,
                **models,
                "num_floating_point_operations_so_far": 0,
            }
    return files
