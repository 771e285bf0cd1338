"""`TensorParallelHooks`: everything GPTModel builds or runs differently under tensor parallelism, in one typed
object; `ContextParallelHooks`: the same for context parallelism (the attention over the whole sequence).

Both are parts of the rank's `RankSpec` (model/rank_spec.py), handed to GPTModel at construction; the defaults
are one process. parallel/tensor_parallel.tensor_parallel_hooks builds the tp version from the rank's tp group:
the layers (`LayerFactories`: column-, row- and vocab-parallel layers over that group), the vocab-parallel loss
and its reductions, the output layer's input handling, the sequence-parallel split after the embedding. The
layers and the hooks come from one group, so they agree by construction. model/ stays free of
torch.distributed: the factories and hooks are plain callables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from model.kernels import CrossEntropyReductions
from model.kernels.reference import cross_entropy_per_token

TensorFn = Callable[[torch.Tensor], torch.Tensor]
# q [s, b, nq, d], k, v [s, b, nkv, d], attention mask or None -> context [s, b, nq * d]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def identity(x: torch.Tensor) -> torch.Tensor:
    """The hook that does nothing (one process)."""
    return x


def plain_column_linear(in_features: int, out_features: int, bias: bool, stacked: int) -> nn.Module:
    """nn.Linear: the one-process column linear (`stacked` blocks along the output only matter when split)."""
    return nn.Linear(in_features, out_features, bias=bias)


def plain_row_linear(in_features: int, out_features: int, bias: bool) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias)


def plain_word_embedding(rows: int, dim: int) -> nn.Module:
    return plain_embedding(rows, dim)


def plain_embedding(rows: int, dim: int) -> nn.Embedding:
    """nn.Embedding, whose default init is skipped on the meta device, where the trainer builds its models
    (model/init.py gives every weight its value once materialized): `normal_` on a meta tensor runs torch._refs'
    Python implementation, whose first call imports torch._dynamo and Triton (~1.4 CPU s at every trainer start
    on a rank). Built on a real device (a test, a tool) it is initialized as torch's own."""
    embedding = nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
    if not embedding.weight.is_meta:
        embedding.reset_parameters()
    return embedding


def plain_output_layer(in_features: int, rows: int) -> nn.Module:
    return nn.Linear(in_features, rows, bias=False)


@dataclass(frozen=True)
class LayerFactories:
    """How GPTModel makes the layers tensor parallelism splits (defaults: torch's modules, one process).

    column_linear(in, out, bias, stacked)  [s(/tp), b, in] -> [s, b, out(/tp)]: attention.qkv, mlp.fc1
                                           (`stacked` blocks along out split separately: SwiGLU's [gate; up])
    row_linear(in, out, bias)              [s, b, in(/tp)] -> [s(/tp), b, out]: attention.proj, mlp.fc2
    word_embedding(rows, dim)              the vocabulary table, split by rows
    output_layer(in, rows)                 the head, split by vocabulary rows, no bias: logits [s, b, V(/tp)]
    Each parameter they make carries its `Sharding` (model/param_info.py).
    """

    column_linear: Callable[[int, int, bool, int], nn.Module] = plain_column_linear
    row_linear: Callable[[int, int, bool], nn.Module] = plain_row_linear
    word_embedding: Callable[[int, int], nn.Module] = plain_word_embedding
    output_layer: Callable[[int, int], nn.Module] = plain_output_layer


@dataclass(frozen=True)
class TensorParallelHooks:
    """What GPTModel builds and calls where tensor parallelism changes the computation.

    tp_size                       the tensor-parallel size these hooks and layers were made for
    tp_rank                       this rank's place in its tp group (where its vocabulary shard starts)
    sequence_parallel             norms see s/tp tokens: their parameters' gradients are partial (ParamInfo)
    layers                        the factories of the split layers (`LayerFactories`)
    scatter_to_sequence_parallel  the embedding's output [s, b, h] -> this rank's [s/tp, b, h] under sequence
                                  parallelism (backward: all-gather); identity otherwise
    loss_fn                       per-token loss [s, b] from logits [s, b, V(/tp)] and labels [s, b]
                                  (vocab-parallel cross entropy under tp)
    head_input                    what the output layer does to its input before the GEMM, for the fused
                                  linear + cross entropy (sequence-parallel all-gather / tp copy)
    loss_reductions               the fused loss's reductions of its statistics over the vocabulary shards
    """

    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    layers: LayerFactories = field(default_factory=LayerFactories)
    scatter_to_sequence_parallel: TensorFn = identity
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_per_token
    head_input: TensorFn = identity
    loss_reductions: CrossEntropyReductions = field(default_factory=CrossEntropyReductions)


@dataclass(frozen=True)
class ContextParallelHooks:
    """What GPTModel calls where context parallelism changes the computation (defaults: one process).

    attention  causal attention of this rank's queries over the keys of the whole sequence, held by the cp
               group (parallel/context_parallel.py: ring attention); None: scaled_dot_product_attention on
               the local sequence. Positions need no hook: each token's position id is its true index.
    """

    attention: AttentionFn | None = None
