"""`TensorParallelHooks`: everything GPTModel runs differently under tensor parallelism, in one typed object;
`ContextParallelHooks`: the same for context parallelism (the attention over the whole sequence).

GPTModel takes it at construction; the defaults are one process. parallel/tensor_parallel.tensor_parallel_hooks
builds the tp version from the rank's tp group (the vocab-parallel loss and its reductions, the output layer's
input handling, the sequence-parallel split after the embedding), and apply_tensor_parallel refuses a model
whose hooks were made for another tp size. model/ stays free of torch.distributed: the hooks are plain callables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model.kernels import CrossEntropyReductions
from model.kernels.reference import cross_entropy_per_token

TensorFn = Callable[[torch.Tensor], torch.Tensor]
# q [s, b, nq, d], k, v [s, b, nkv, d], attention mask or None -> context [s, b, nq * d]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def identity(x: torch.Tensor) -> torch.Tensor:
    """The hook that does nothing (one process)."""
    return x


@dataclass(frozen=True)
class TensorParallelHooks:
    """What GPTModel.forward calls where tensor parallelism changes the computation.

    tp_size                       the tensor-parallel size these hooks were made for
    tp_rank                       this rank's place in its tp group (where its vocabulary shard starts)
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
