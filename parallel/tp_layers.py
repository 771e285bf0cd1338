"""Tensor-parallel layers (Megatron's `layers.py` and `cross_entropy.py`), built on parallel/tp_mappings.py.

    ColumnParallelLinear    Y_local = X A_local      A split by output rows     [s, b, h] -> [s, b, out/tp]
    RowParallelLinear       Y = sum_r X_r A_r + b    A split by input columns   [s, b, in/tp] -> [s, b, out]
    VocabParallelEmbedding  rows of the table split by vocabulary, lookups outside the shard give 0
    vocab_parallel_softmax  the softmax over the whole vocabulary from logits [.., V/tp] without gathering them
    vocab_parallel_cross_entropy  per-token loss [s, b] from it (evaluation/scoring.py reads log-probabilities)

GPTModel builds them directly (parallel/tensor_parallel.tp_layer_factories). Every parameter they create carries
its ParamInfo (model/param_info.py): full_shape, the `Sharding` the layer declares (split dim, stacked parts; the
model marks the real vocabulary rows of its tables), tp_rank / tp_size and sequence_parallel, read by
model/init.py (which gives it its value: the shard of the full tensor), the checkpoint and the trainer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model.kernels.cross_entropy import owned_target
from model.param_info import REPLICATED, Sharding, set_param_info
from parallel.layout import require_divisible
from parallel.tp_mappings import (
    TPComm,
    all_reduce,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
)


def _new_param(
    shape: tuple[int, ...],
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    comm: TPComm,
    sharding: Sharding,
    *,
    full_shape: tuple[int, ...],
    sequence_parallel: bool = False,
) -> nn.Parameter:
    """An uninitialised parameter of the local `shape` (model/init.py gives it its value, the shard of the
    full tensor `full_shape`), its ParamInfo carrying the layer's split, the rank's place in the tp group and
    whether it is sequence-parallel."""
    param = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    set_param_info(
        param,
        sharding=sharding,
        tp_rank=comm.rank,
        tp_size=comm.size,
        full_shape=full_shape,
        sequence_parallel=sequence_parallel,
    )
    return param


def column_parallel_input(x: torch.Tensor, comm: TPComm, sequence_parallel: bool) -> torch.Tensor:
    """The input of a column-parallel GEMM: [s/tp, b, in] all-gathered with sequence parallelism (backward:
    reduce-scatter), else the replicated [s, b, in] entering the tp region (backward: all-reduce)."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, comm)
    return copy_to_tp_region(x, comm)


def _check_divisible(what: str, value: int, size: int) -> None:
    require_divisible(what, value, "parallel.tp_size", size)


class _ParallelLinear(nn.Module):
    """What ColumnParallelLinear and RowParallelLinear share: making the weight [out(/tp), in(/tp)] and bias
    from the layer's split (the subclass says which dimension)."""

    comm: TPComm
    in_features: int
    out_features: int
    weight: nn.Parameter
    bias: nn.Parameter | None

    def _make_params(
        self,
        weight_shape: tuple[int, int],
        weight_split: Sharding,
        bias_shape: tuple[int] | None,
        bias_split: Sharding,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        bias_sequence_parallel: bool = False,
    ) -> None:
        """Set self.weight (local `weight_shape`) and self.bias (local `bias_shape`, None: no bias)."""
        self.weight = _new_param(
            weight_shape, device, dtype, self.comm, weight_split, full_shape=(self.out_features, self.in_features)
        )
        self.bias = None
        if bias_shape is not None:
            self.bias = _new_param(
                bias_shape,
                device,
                dtype,
                self.comm,
                bias_split,
                full_shape=(self.out_features,),
                sequence_parallel=bias_sequence_parallel,
            )


class ColumnParallelLinear(_ParallelLinear):
    """Linear with the weight [out, in] split along `out`: [s(/tp), b, in] -> [s, b, out/tp].

    Input: with sequence parallelism the [s/tp, b, in] shards are all-gathered (backward: reduce-scatter),
    else the replicated input enters the tp region through copy (backward: all-reduce of partial grads).
    `gather_output` all-gathers the result to [s, b, out] (unused by the GPT: the next op is row-parallel
    or the vocab-parallel loss). `num_stacked` blocks along `out` are split separately (SwiGLU's fc1).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: TPComm,
        *,
        bias: bool = True,
        sequence_parallel: bool = False,
        gather_output: bool = False,
        num_stacked: int = 1,
        device=None,
        dtype=None,
    ):
        super().__init__()
        _check_divisible(f"output size per block ({num_stacked} blocks)", out_features // num_stacked, comm.size)
        if gather_output and num_stacked > 1:
            raise ValueError("gather_output with stacked blocks would interleave them: not supported")
        self.comm, self.sequence_parallel, self.gather_output = comm, sequence_parallel, gather_output
        self.in_features, self.out_features = in_features, out_features
        out_local = out_features // comm.size
        split = Sharding(dim=0, parts=num_stacked)
        self._make_params((out_local, in_features), split, (out_local,) if bias else None, split, device, dtype)

    def forward(self, x: torch.Tensor, skip_bias_add: bool = False):
        """[s(/tp), b, in] -> [s, b, out/tp]; with skip_bias_add (y without bias, bias) for a fused epilogue."""
        x = column_parallel_input(x, self.comm, self.sequence_parallel)
        if skip_bias_add:
            if self.gather_output:
                raise ValueError("skip_bias_add with gather_output would return a sharded bias: not supported")
            return F.linear(x, self.weight), self.bias
        y_local = F.linear(x, self.weight, self.bias)  # [s, b, out/tp]
        return gather_from_tp_region(y_local, self.comm) if self.gather_output else y_local

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, out_local={self.weight.shape[0]}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(_ParallelLinear):
    """Linear with the weight [out, in] split along `in`: [s, b, in/tp] -> [s(/tp), b, out].

    The partial products are summed over tp by an all-reduce, or with sequence parallelism by a
    reduce-scatter along s. The bias is replicated and added after the reduction (once, not tp times);
    under sequence parallelism its gradient is partial, so it is marked `sequence_parallel`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: TPComm,
        *,
        bias: bool = True,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        _check_divisible("input size", in_features, comm.size)
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        # The bias is replicated, added once after the reduction; under sequence parallelism its grad is partial.
        bias_shape = (out_features,) if bias else None
        weight_shape = (out_features, in_features // comm.size)
        self._make_params(weight_shape, Sharding(dim=1), bias_shape, REPLICATED, device, dtype, sequence_parallel)

    def forward(self, x_local: torch.Tensor, skip_bias_add: bool = False):
        """[s, b, in/tp] -> [s(/tp), b, out]; with skip_bias_add (y without bias, bias) for a fused epilogue."""
        partial_sum = F.linear(x_local, self.weight)  # [s, b, out], this rank's share of the sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial_sum, self.comm)  # [s/tp, b, out]
        else:
            y = reduce_from_tp_region(partial_sum, self.comm)  # [s, b, out]
        if skip_bias_add:
            return y, self.bias
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, in_local={self.weight.shape[1]}, out={self.out_features}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Embedding table [V, h] split by vocabulary rows; each rank looks up the ids in its range, zeros the
    others, and the all-reduce sums the one non-zero contribution: ids [b, s] -> [b, s, h] replicated."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        comm: TPComm,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        _check_divisible("padded vocabulary size", num_embeddings, comm.size)
        self.comm = comm
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        rows_local = num_embeddings // comm.size
        self.vocab_start, self.vocab_end = comm.rank * rows_local, (comm.rank + 1) * rows_local
        self.weight = _new_param(
            (rows_local, embedding_dim),
            device,
            dtype,
            comm,
            Sharding(dim=0),
            full_shape=(num_embeddings, embedding_dim),
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # [b, s, h]
        return reduce_from_tp_region(out, self.comm)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end})"


class VocabSoftmax(NamedTuple):
    """The softmax of vocabulary-sharded logits at each position, from `vocab_parallel_softmax`."""

    exp_shifted: torch.Tensor  # [..., V/tp] fp32 exp(logit - global max) of this rank's columns (fresh: writable)
    sum_exp: torch.Tensor  # [...] their sum over the whole vocabulary (every rank)
    target_shifted: torch.Tensor  # [...] the target's logit - global max (every rank)
    global_max: torch.Tensor  # [...] the largest logit over the whole vocabulary (every rank)
    target_local: torch.Tensor  # [...] int64 the target's column on this rank (clamped where not owned)
    owned: torch.Tensor  # [...] bool: this rank holds the target's column

    def log_prob(self) -> torch.Tensor:
        """[...] fp32 log-probability of the target: exactly minus the cross-entropy loss."""
        return self.target_shifted - self.sum_exp.log()


def vocab_parallel_softmax(logits_local: torch.Tensor, target: torch.Tensor, comm: TPComm) -> VocabSoftmax:
    """Stable softmax over a vocabulary split across tp, in fp32: three all-reduces of [...] tensors (max,
    target logit, sum of exp) instead of gathering [..., V]. Rank r holds ids [r * V/tp, (r + 1) * V/tp);
    padding columns must already be -inf. The loss and the evaluation's scores both read it."""
    logits = logits_local.float()
    global_max = all_reduce(logits.max(dim=-1).values, comm, "forward", op=dist.ReduceOp.MAX)
    logits = logits - global_max.unsqueeze(-1)  # a fresh fp32 tensor that we may overwrite
    vocab_local = logits.shape[-1]
    target_local, owned = owned_target(target, comm.rank * vocab_local, vocab_local)
    target_shifted = logits.gather(-1, target_local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
    target_shifted = all_reduce(target_shifted, comm, "forward")
    exp_shifted = logits.exp_()
    sum_exp = all_reduce(exp_shifted.sum(dim=-1), comm, "forward")
    return VocabSoftmax(exp_shifted, sum_exp, target_shifted, global_max, target_local, owned)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over a vocabulary split across tp (vocab_parallel_softmax), with its own backward."""

    @staticmethod
    def forward(ctx, logits_local: torch.Tensor, target: torch.Tensor, comm: TPComm) -> torch.Tensor:
        # logits_local [s, b, V/tp] (any float dtype), target [s, b] -> loss [s, b] fp32
        parts = vocab_parallel_softmax(logits_local, target, comm)
        softmax = parts.exp_shifted.div_(parts.sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, parts.owned, parts.target_local)
        ctx.input_dtype = logits_local.dtype
        return parts.sum_exp.log() - parts.target_shifted

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        # d loss / d logit_v = softmax_v - [v == target]; only the owner of the target subtracts the 1
        # (the others add -0.0 at their clamped column: no change).
        softmax, owned, target_local = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, target_local.unsqueeze(-1), -owned.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, labels: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Per-token loss [s, b] in fp32 from vocabulary-sharded logits [s, b, V/tp] and labels [s, b]."""
    return _VocabParallelCrossEntropy.apply(logits_local, labels, comm)
