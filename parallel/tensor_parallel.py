"""Tensor model parallelism with optional sequence parallelism: what a rank's GPTModel is built with.

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

`tensor_parallel_hooks(comm)` is the model's whole tp seam (model/tp_hooks.py), made from one tp group: the
factories GPTModel builds its split layers with (parallel/tp_layers.py) and the hooks it calls (the
vocab-parallel loss, the fused loss's input handling and reductions, the sequence-parallel split), so layers
and hooks agree by construction. The layers declare how each parameter is split (model/param_info.Sharding);
`param_shardings` gives those records per global name for a ModelConfig without a live sharded model (the
converters' view, valid at tp = 1 too).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from model.config import ModelConfig
from model.gpt import GPTModel
from model.kernels import CrossEntropyReductions, KernelSelection
from model.param_info import Sharding, param_info
from model.rank_spec import RankSpec
from model.tp_hooks import LayerFactories, TensorParallelHooks, identity
from parallel.state import ParallelState
from parallel.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_input,
    vocab_parallel_cross_entropy,
)
from parallel.tp_mappings import CommCounter, TPComm, all_reduce, scatter_to_sequence_parallel_region


def tp_comm(state: ParallelState, counter: CommCounter | None = None, scope: str = "layer") -> TPComm:
    """The TPComm of this rank's tp group."""
    return TPComm(state.tp_group, state.tp_rank, state.tp_size, counter, scope, state.comm)


def _column_linear(
    comm: TPComm, sequence_parallel: bool, in_features: int, out_features: int, bias: bool, stacked: int
) -> nn.Module:
    return ColumnParallelLinear(
        in_features, out_features, comm, bias=bias, sequence_parallel=sequence_parallel, num_stacked=stacked
    )


def _row_linear(comm: TPComm, sequence_parallel: bool, in_features: int, out_features: int, bias: bool) -> nn.Module:
    return RowParallelLinear(in_features, out_features, comm, bias=bias, sequence_parallel=sequence_parallel)


def _word_embedding(comm: TPComm, rows: int, dim: int) -> nn.Module:
    return VocabParallelEmbedding(rows, dim, comm)


def _output_layer(comm: TPComm, sequence_parallel: bool, in_features: int, rows: int) -> nn.Module:
    # split by vocabulary: logits stay [s, b, V/tp]
    return ColumnParallelLinear(in_features, rows, comm, bias=False, sequence_parallel=sequence_parallel)


def tp_layer_factories(comm: TPComm, sequence_parallel: bool) -> LayerFactories:
    """The split layers over `comm`'s group (collectives counted under the scopes "layer", "embedding",
    "output"): qkv and fc1 column-parallel, proj and fc2 row-parallel, the vocabulary tables by rows."""
    return LayerFactories(
        column_linear=partial(_column_linear, comm, sequence_parallel),
        row_linear=partial(_row_linear, comm, sequence_parallel),
        word_embedding=partial(_word_embedding, comm.with_scope("embedding")),
        output_layer=partial(_output_layer, comm.with_scope("output"), sequence_parallel),
    )


def tensor_parallel_hooks(comm: TPComm, sequence_parallel: bool = False) -> TensorParallelHooks:
    """What GPTModel builds and runs differently on the tp group `comm` (the one-process defaults for one rank):
    the split layers, the vocab-parallel loss, the fused loss's input handling and reductions, the
    sequence-parallel split."""
    if comm.size == 1:
        return TensorParallelHooks()
    loss_comm = comm.with_scope("loss")
    return TensorParallelHooks(
        tp_size=comm.size,
        tp_rank=comm.rank,
        sequence_parallel=sequence_parallel,
        layers=tp_layer_factories(comm, sequence_parallel),
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
    layer listed under its own name too). Built on the meta device with the split layers over a one-rank tp
    group: no weights, no process group."""
    layers = tp_layer_factories(TPComm(group=None, rank=0, size=1), sequence_parallel=False)
    spec = RankSpec(kernels=KernelSelection(), tp=TensorParallelHooks(layers=layers))
    with torch.device("meta"):
        model = GPTModel(cfg, cfg.padded_vocab_size(1), spec=spec)
    return {name: param_info(p).sharding for name, p in model.named_parameters(remove_duplicate=False)}
