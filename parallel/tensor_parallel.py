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

The layers (parallel/tp_layers.py) declare how each parameter is split (model/param_info.Sharding);
`param_shardings` gives those records per global name for a ModelConfig without a live sharded model (the
converters' view, valid at tp = 1 too). `tensor_parallel_hooks` builds what GPTModel runs differently under tp
(model/tp_hooks.py), handed to it at construction.
"""

from __future__ import annotations

from functools import partial
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from model.config import ModelConfig
from model.gpt import GPTModel
from model.kernels import CrossEntropyReductions
from model.param_info import Sharding, param_info, set_param_info
from model.tp_hooks import TensorParallelHooks, identity
from parallel.layout import check_tensor_parallel
from parallel.random import ForkRNG, RNGTracker
from parallel.state import ParallelState
from parallel.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_input,
    vocab_parallel_cross_entropy,
)
from parallel.tp_mappings import CommCounter, TPComm, all_reduce, scatter_to_sequence_parallel_region

ModuleT = TypeVar("ModuleT", bound=nn.Module)

# Which linear of a TransformerLayer becomes which parallel layer.
LAYER_PLAN: tuple[tuple[str, type[ColumnParallelLinear] | type[RowParallelLinear]], ...] = (
    ("attention.qkv", ColumnParallelLinear),
    ("attention.proj", RowParallelLinear),
    ("mlp.fc1", ColumnParallelLinear),
    ("mlp.fc2", RowParallelLinear),
)


def tp_comm(state: ParallelState, counter: CommCounter | None = None, scope: str = "layer") -> TPComm:
    """The TPComm of this rank's tp group."""
    return TPComm(state.tp_group, state.tp_rank, state.tp_size, counter, scope, state.comm)


def tensor_parallel_hooks(comm: TPComm, sequence_parallel: bool = False) -> TensorParallelHooks:
    """What GPTModel runs differently on the tp group `comm` (the one-process defaults for one rank): the
    vocab-parallel loss, the fused loss's input handling and reductions, the sequence-parallel split."""
    if comm.size == 1:
        return TensorParallelHooks()
    loss_comm = comm.with_scope("loss")
    return TensorParallelHooks(
        tp_size=comm.size,
        # [s, b, h] replicated after the vocab all-reduce -> this rank's [s/tp, b, h] (backward: all-gather)
        scatter_to_sequence_parallel=(
            partial(scatter_to_sequence_parallel_region, comm=comm.with_scope("embedding"))
            if sequence_parallel
            else identity
        ),
        loss_fn=partial(vocab_parallel_cross_entropy, comm=loss_comm),
        # the fused chunked loss (model/kernels): the output layer's input handling and the same three
        # reductions as vocab_parallel_cross_entropy
        head_input=partial(column_parallel_input, comm=comm.with_scope("output"), sequence_parallel=sequence_parallel),
        loss_reductions=CrossEntropyReductions(
            max=partial(all_reduce, comm=loss_comm, phase="forward", op=dist.ReduceOp.MAX),
            sum=partial(all_reduce, comm=loss_comm, phase="forward"),
        ),
    )


def param_shardings(cfg: ModelConfig) -> dict[str, Sharding]:
    """{global parameter name: Sharding} of the whole model, as the tp layers declare them (the tied output
    layer listed under its own name too). Built on the meta device with a one-rank tp group: no weights,
    no process group."""
    with torch.device("meta"):
        model = GPTModel(cfg, cfg.padded_vocab_size(1))
        _shard_modules(model, TPComm(group=None, rank=0, size=1), sequence_parallel=False)
    return {name: param_info(p).sharding for name, p in model.named_parameters(remove_duplicate=False)}


def apply_tensor_parallel(
    model: GPTModel,
    state: ParallelState,
    sequence_parallel: bool = False,
    comm_counter: CommCounter | None = None,
    rng_tracker: RNGTracker | None = None,
) -> GPTModel:
    """Shard `model` (preferably still on the meta device) over `state`'s tp group, in place; returns it.

    The model must have been built with `tensor_parallel_hooks` for the same tp group. Call before
    model/init.initialize_parameters and model.tie_weights(): the new parameters carry a ParamInfo with
    full_shape, sharding and tp rank so that init draws the full tensor and keeps this rank's shard. A model
    with real weights is sharded from its own values. Dropout in tp regions (attention; with sequence parallelism also
    the hidden and embedding dropouts) is wrapped to draw from `rng_tracker`'s tp-specific state; without a
    tracker it draws from the default generator (fine for dropout 0 and for tests).
    """
    check_tensor_parallel(model.cfg, state.tp_size, sequence_parallel)
    if model.tp_hooks.tp_size != state.tp_size:
        raise ValueError(
            f"the model was built with tensor-parallel hooks for tp_size={model.tp_hooks.tp_size} but is sharded "
            f"over parallel.tp_size={state.tp_size}: build it with tensor_parallel_hooks(tp_comm(state))"
        )
    _wrap_dropouts(model, sequence_parallel and state.tp_size > 1, rng_tracker)
    if state.tp_size == 1:
        return model  # nothing to split; the default ParamInfo says replicated
    _shard_modules(model, tp_comm(state, comm_counter), sequence_parallel)
    _mark_replicated(model, sequence_parallel)
    return model


def _shard_modules(model: GPTModel, comm: TPComm, sequence_parallel: bool) -> None:
    """Swap every Linear / Embedding of LAYER_PLAN, the word embedding and the output layer for its parallel
    layer (the parameters' Sharding records come with them)."""
    for _, layer in model.transformer_layers():
        _shard_layer(layer, model.cfg, comm, sequence_parallel)
    if model.embedding is not None:
        embedding = model.embedding
        embedding.word_embeddings = VocabParallelEmbedding.from_embedding(
            _plain(embedding.word_embeddings, nn.Embedding), comm.with_scope("embedding")
        )
    if model.output_layer is not None:  # split by vocabulary: logits stay [s, b, V/tp]
        model.output_layer = ColumnParallelLinear.from_linear(
            _plain(model.output_layer, nn.Linear), comm.with_scope("output"), sequence_parallel=sequence_parallel
        )
        if model.cfg.tie_embeddings and model.embedding is not None:
            model.output_layer.weight = model.word_embedding_weight()


def _plain(module: nn.Module, kind: type[ModuleT]) -> ModuleT:
    """`module` as the plain torch module it must be before sharding (sharding twice is a bug)."""
    if not isinstance(module, kind):
        raise TypeError(f"expected a plain {kind.__name__} to shard, got {type(module).__name__}")
    return module


def _shard_layer(layer: nn.Module, cfg: ModelConfig, comm: TPComm, sequence_parallel: bool) -> None:
    for path, parallel_cls in LAYER_PLAN:
        parent_path, name = path.rsplit(".", 1)
        parent = layer.get_submodule(parent_path)
        kwargs: dict[str, bool | int] = {"sequence_parallel": sequence_parallel}
        if path == "mlp.fc1" and cfg.activation == "swiglu":
            kwargs["num_stacked"] = 2  # [gate; up]
        setattr(parent, name, parallel_cls.from_linear(getattr(parent, name), comm, **kwargs))


def _mark_replicated(model: nn.Module, sequence_parallel: bool) -> None:
    """Give every parameter not sharded above the replicated conventions. Norm weights/biases see only
    s/tp tokens under sequence parallelism, so their gradients are partial: mark them."""
    for name, param in model.named_parameters():
        if param_info(param).full_shape is not None:
            continue  # made by a parallel layer above (which sets full_shape)
        set_param_info(param, full_shape=tuple(param.shape), sequence_parallel=sequence_parallel and "norm." in name)


def _wrap_dropouts(model: GPTModel, sequence_parallel: bool, rng_tracker: RNGTracker | None) -> None:
    """Attention dropout acts on this rank's heads: tp-specific stream. Hidden/embedding dropout acts on
    replicated activations (shared stream) unless sequence parallelism shards them along s."""
    if rng_tracker is None:
        return
    for _, layer in model.transformer_layers():
        layer.attention.core = ForkRNG(layer.attention.core, rng_tracker)
        if sequence_parallel:
            layer.hidden_dropout = ForkRNG(layer.hidden_dropout, rng_tracker)
    if sequence_parallel and model.embedding is not None:
        model.embedding.dropout = ForkRNG(model.embedding.dropout, rng_tracker)
