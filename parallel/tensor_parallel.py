"""Tensor model parallelism with optional sequence parallelism, applied to a plain GPTModel from outside.

Megatron's split of a transformer layer over the tp ranks (Narayanan et al. SC21, Shoeybi et al. 2019):

    attention.qkv   column-parallel: whole query groups per rank (qkv is laid out per group)
    attention.proj  row-parallel
    mlp.fc1         column-parallel (SwiGLU: rank r keeps its slice of both the gate and the up half)
    mlp.fc2         row-parallel
    embedding.word_embeddings, output_layer: split along the vocabulary; the loss is vocab-parallel

Forward costs two all-reduces per layer (after proj and fc2), backward two (before qkv and fc1). With
sequence parallelism (Korthikanti et al. 2022) the activations between layers, the norms and the hidden
dropouts are sharded along s ([s/tp, b, h]) and each all-reduce becomes an all-gather before the column-
parallel layer and a reduce-scatter after the row-parallel one; the gradients of the replicated norm weights
and row-parallel biases are then partial (ParamInfo.sequence_parallel) and
`grad_utils.finalize_model_grads` sums them over tp.

Layers and mappings live in parallel/tp_layers.py and parallel/tp_mappings.py; this file re-exports them.
"""

from __future__ import annotations

from functools import partial

import torch.distributed as dist
from torch import nn

from model.config import ModelConfig
from model.gpt import GPTModel
from model.kernels import CrossEntropyReductions
from model.param_info import param_info, set_param_info
from parallel.layout import check_tensor_parallel
from parallel.random import ForkRNG, RNGTracker
from parallel.state import ParallelState
from parallel.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from parallel.tp_mappings import (
    CommCounter,
    TPComm,
    all_reduce,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)

__all__ = [
    "ColumnParallelLinear",
    "CommCounter",
    "RowParallelLinear",
    "TPComm",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "copy_to_tp_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region",
    "tp_comm",
    "vocab_parallel_cross_entropy",
]

# Which linear of a TransformerLayer becomes which parallel layer.
LAYER_PLAN: tuple[tuple[str, type], ...] = (
    ("attention.qkv", ColumnParallelLinear),
    ("attention.proj", RowParallelLinear),
    ("mlp.fc1", ColumnParallelLinear),
    ("mlp.fc2", RowParallelLinear),
)


def tp_comm(state: ParallelState, counter: CommCounter | None = None, scope: str = "layer") -> TPComm:
    """The TPComm of this rank's tp group."""
    return TPComm(group=state.tp_group, rank=state.tp_rank, size=state.tp_size, counter=counter, scope=scope)


def apply_tensor_parallel(
    model: GPTModel,
    state: ParallelState,
    sequence_parallel: bool = False,
    comm_counter: CommCounter | None = None,
    rng_tracker: RNGTracker | None = None,
) -> GPTModel:
    """Shard `model` (preferably still on the meta device) over `state`'s tp group, in place; returns it.

    Call before model/init.initialize_parameters and model.tie_weights(): the new parameters carry
    a ParamInfo with full_shape / shard_fn so that init draws the full tensor and keeps this rank's shard. A model with real
    weights is sharded from its own values. Dropout in tp regions (attention; with sequence parallelism also
    the hidden and embedding dropouts) is wrapped to draw from `rng_tracker`'s tp-specific state; without a
    tracker it draws from the default generator (fine for dropout 0 and for tests).
    """
    check_tensor_parallel(model.cfg, state.tp_size, sequence_parallel)
    _wrap_dropouts(model, sequence_parallel and state.tp_size > 1, rng_tracker)
    if state.tp_size == 1:
        return model  # nothing to split; the default ParamInfo says replicated
    comm = tp_comm(state, comm_counter)
    for layer in model.layers.values():
        _shard_layer(layer, model.cfg, comm, sequence_parallel)
    if model.pre_process:
        _shard_embedding(model, comm.with_scope("embedding"), sequence_parallel)
    if model.post_process:
        _shard_head(model, comm, sequence_parallel)
    _mark_replicated(model, sequence_parallel)
    return model


def _shard_layer(layer: nn.Module, cfg: ModelConfig, comm: TPComm, sequence_parallel: bool) -> None:
    for path, parallel_cls in LAYER_PLAN:
        parent_path, name = path.rsplit(".", 1)
        parent = layer.get_submodule(parent_path)
        kwargs = {"sequence_parallel": sequence_parallel}
        if path == "mlp.fc1" and cfg.activation == "swiglu":
            kwargs["num_stacked"] = 2  # [gate; up]
        setattr(parent, name, parallel_cls.from_linear(getattr(parent, name), comm, **kwargs))


def _shard_embedding(model: GPTModel, comm: TPComm, sequence_parallel: bool) -> None:
    embedding = model.embedding
    embedding.word_embeddings = VocabParallelEmbedding.from_embedding(embedding.word_embeddings, comm)
    if sequence_parallel:
        # [s, b, h] replicated after the vocab all-reduce -> this rank's [s/tp, b, h] (backward: all-gather)
        embedding.scatter_to_sequence_parallel = partial(scatter_to_sequence_parallel_region, comm=comm)


def _shard_head(model: GPTModel, comm: TPComm, sequence_parallel: bool) -> None:
    """Output layer split by vocabulary (logits stay [s, b, V/tp]) and the vocab-parallel loss."""
    model.output_layer = ColumnParallelLinear.from_linear(
        model.output_layer, comm.with_scope("output"), sequence_parallel=sequence_parallel
    )
    if model.cfg.tie_embeddings and model.pre_process:
        model.output_layer.weight = model.embedding.word_embeddings.weight
    model.vocab_start_index = comm.rank * model.output_layer.weight.shape[0]  # for the padding mask
    model.loss_fn = partial(vocab_parallel_cross_entropy, comm=comm.with_scope("loss"))
    # the fused chunked loss (model/kernels): same input handling and the same three reductions
    model.head_input_fn = model.output_layer.gather_input
    model.loss_reductions = CrossEntropyReductions(
        max=partial(all_reduce, comm=comm.with_scope("loss"), phase="forward", op=dist.ReduceOp.MAX),
        sum=partial(all_reduce, comm=comm.with_scope("loss"), phase="forward"),
    )


def _mark_replicated(model: nn.Module, sequence_parallel: bool) -> None:
    """Give every parameter not sharded above the replicated conventions. Norm weights/biases see only
    s/tp tokens under sequence parallelism, so their gradients are partial: mark them."""
    for name, param in model.named_parameters():
        if param_info(param).full_shape is not None:
            continue  # made by a parallel layer above (which sets full_shape)
        set_param_info(
            param,
            tensor_parallel=False,
            partition_dim=-1,
            full_shape=tuple(param.shape),
            sequence_parallel=sequence_parallel and "norm." in name,
        )


def _wrap_dropouts(model: GPTModel, sequence_parallel: bool, rng_tracker: RNGTracker | None) -> None:
    """Attention dropout acts on this rank's heads: tp-specific stream. Hidden/embedding dropout acts on
    replicated activations (shared stream) unless sequence parallelism shards them along s."""
    if rng_tracker is None:
        return
    for layer in model.layers.values():
        layer.attention.core = ForkRNG(layer.attention.core, rng_tracker)
        if sequence_parallel:
            layer.hidden_dropout = ForkRNG(layer.hidden_dropout, rng_tracker)
    if sequence_parallel and model.embedding is not None:
        model.embedding.dropout = ForkRNG(model.embedding.dropout, rng_tracker)
