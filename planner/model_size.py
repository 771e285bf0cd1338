"""Parameter counts of one tensor-parallel rank, from the model section alone (no torch).

Mirrors model/gpt.py and parallel/tensor_parallel.py: column-parallel weights and biases (qkv, fc1) and
row-parallel weights (proj, fc2) are split over tp, row-parallel biases and norms are replicated, the word
embedding and the output layer are split along the vocabulary. tests/planner/test_model_size.py checks these
counts against the meta-device model of tools/model_stats.py.
"""

from __future__ import annotations

from typing import Any


def qkv_width(model: Any) -> int:
    """Output width of the fused qkv projection: (heads + 2 * query groups) * head_dim."""
    return (model.num_attention_heads + 2 * model.query_groups) * model.head_dim


def fc1_width(model: Any) -> int:
    return model.ffn_size * (2 if model.activation == "swiglu" else 1)


def layer_params(model: Any, tp_size: int) -> int:
    """Parameters of one transformer layer on one tp rank."""
    h = model.hidden_size
    norm = 2 * h if model.normalization == "layernorm" else h
    qkv, fc1, ffn = qkv_width(model), fc1_width(model), model.ffn_size
    weights = (h * qkv + h * h + h * fc1 + ffn * h) // tp_size
    biases = (qkv + fc1) // tp_size + 2 * h if model.add_bias_linear else 0
    return weights + biases + 2 * norm


def embedding_params(model: Any, tp_size: int) -> int:
    """Word embedding shard plus learned position embeddings (replicated), on virtual stage 0."""
    vocab_local = model.padded_vocab_size(tp_size) // tp_size
    positions = model.max_positions * model.hidden_size if model.position_embedding_type == "learned" else 0
    return vocab_local * model.hidden_size + positions


def head_params(model: Any, tp_size: int, holds_embedding: bool) -> int:
    """Final norm plus the output layer shard on the last virtual stage (shared when tied on one stage)."""
    h = model.hidden_size
    norm = 2 * h if model.normalization == "layernorm" else h
    shared = model.tie_embeddings and holds_embedding
    output = 0 if shared else model.padded_vocab_size(tp_size) // tp_size * h
    return norm + output


def rank_params(model: Any, tp_size: int, pp_size: int, vp_size: int, pp_rank: int) -> int:
    """Parameters held by one (tp rank, pp rank): its layers, plus the embedding and/or head it holds."""
    layers = model.num_layers // pp_size  # vp chunks of num_layers / (pp * vp) each
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    total = layers * layer_params(model, tp_size)
    if first:
        total += embedding_params(model, tp_size)
    if last:
        total += head_params(model, tp_size, holds_embedding=first)
    return total


def total_params(model: Any) -> int:
    """The whole model counted once (tied embedding once), as on one process."""
    return rank_params(model, 1, 1, 1, 0)
