"""Gradient helpers on `param.main_grad`: the all-reduces that finish a step's gradients across the model
parallel dimensions, and the pieces of the global gradient norm and clipping.

`finalize_model_grads` runs after `GradientSync.finish_grad_sync()` (parallel/grad_sync.py):
  * the tied word embedding lives on the first and the last pipeline stage; its two gradients are summed
    over `state.embedding_group` (or on the rank itself where one rank holds both, zb-v's V placement) so
    both copies take the same step;
  * sequence-parallel norm (and bias) params are replicated over tp but each tp rank saw only its part of
    the sequence; their gradients are summed over `state.tp_group`.
With the distributed optimizer only the dp shard this rank owns holds reduced gradients, so only that part
(`DataParallel.owned_main_grad`) is all-reduced. The buffer layouts agree across the ranks of
both groups (the embedding has a bucket of its own; tp ranks hold same-shaped shards in the same order), so
every rank of a group reduces the same elements.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from compat.torch_private import foreach_norm
from model.param_info import ParamInfo, param_info
from parallel.comm import Collectives

if TYPE_CHECKING:
    from parallel.grad_sync import GradientSync
    from parallel.state import ParallelState


def all_reduce_coalesced(tensors: list[torch.Tensor], comm: Collectives, group: ProcessGroup | None) -> None:
    """Sum `tensors` over `group` in one collective (flatten, all_reduce, copy back); nothing when they are
    all empty (a distributed-optimizer rank that owns none of them)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce(flat, group)
    offset = 0
    for tensor in tensors:
        tensor.view(-1).copy_(flat[offset : offset + tensor.numel()])
        offset += tensor.numel()


def _unique_params(chunks: Iterable[nn.Module], flag: str) -> list[nn.Parameter]:
    """The parameters whose ParamInfo field `flag` is true, each once."""
    assert flag in ParamInfo.__dataclass_fields__, flag
    seen, found = set(), []
    for chunk in chunks:
        for param in chunk.parameters():
            if getattr(param_info(param), flag) and id(param) not in seen:
                seen.add(id(param))
                found.append(param)
    return found


def finalize_model_grads(chunks: Sequence[nn.Module], state: ParallelState, ddp: GradientSync) -> None:
    """Tied-embedding grads over the embedding group, sequence-parallel grads over tp (see module doc),
    on the part of each main_grad that `ddp` reduced for this rank. A no-op where neither applies
    (pp == 1 or untied embeddings; no sequence-parallel params)."""
    shared = _unique_params(chunks, "shared_embedding")
    if shared and state.stages.embedding_pp_ranks == (state.pp_rank,):
        # One rank holds both ends in different chunks (zb-v's V placement): sum the two copies here.
        first, last = (ddp.owned_main_grad(p) for p in shared)
        first.add_(last)
        last.copy_(first)
    elif shared and state.embedding_group is not None:
        all_reduce_coalesced([ddp.owned_main_grad(p) for p in shared], state.comm, state.embedding_group)
    if state.tp_size > 1:
        replicated = _unique_params(chunks, "sequence_parallel")
        all_reduce_coalesced([ddp.owned_main_grad(p) for p in replicated], state.comm, state.tp_group)


# ---- global gradient norm --------------------------------------------------------------------------
def counts_in_grad_norm(param: nn.Parameter, tp_rank: int) -> bool:
    """Whether `param`'s gradient enters the global norm on this rank, so each element counts once:
    tp-sharded params on every tp rank, replicated ones on tp rank 0, and the tied embedding's last-stage
    copy never (the first stage counts it)."""
    info = param_info(param)
    return (info.tensor_parallel or tp_rank == 0) and not info.embedding_copy


# torch's CPU norm of one fp32 tensor accumulates sequentially: its relative error grows with the length
# (measured here, one thread: 1e-7 at 1e5 elements, 1e-5 at 1e6, 2.5e-4 at 8e6). A single process's grads
# are one flat run of all its parameters, so its grad norm was 5.7e-5 off on configs/gpt_tiny.yaml while a
# sharded run's was not: norms of pieces of at most this many elements keep every layout within ~1e-7.
NORM_PIECE_NUMEL = 1 << 16


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 scalar sum of squares of `tensors` (0 on `device` for an empty list), summed over pieces of at
    most NORM_PIECE_NUMEL elements (views of the flat tensors: no copy for fp32)."""
    pieces = [
        piece
        for t in tensors
        if t.numel()
        for piece in (t.float() if t.dtype != torch.float32 else t).reshape(-1).split(NORM_PIECE_NUMEL)
    ]
    if not pieces:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(foreach_norm(pieces)).pow(2).sum()


def reduce_norm(local_sum_sq: torch.Tensor, comm: Collectives, groups: list[ProcessGroup | None]) -> float:
    """sqrt of the sum over `groups` (one after another; None entries skipped) of a local sum of squares."""
    total = local_sum_sq.clone()
    for group in groups:
        if group is not None:
            comm.all_reduce(total, group)
    return math.sqrt(total.item())  # inf and nan pass through, to be reported


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """Megatron's clipping factor: grads are multiplied by it when it is below 1 (max_norm <= 0: off)."""
    if max_norm <= 0:
        return 1.0
    return max_norm / (grad_norm + 1.0e-6)


def any_non_finite(
    tensors: list[torch.Tensor],
    comm: Collectives,
    groups: list[ProcessGroup | None],
    device: torch.device | str = "cpu",
) -> bool:
    """True if any element of `tensors` on any rank of `groups` is inf or nan (one host sync)."""
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for tensor in tensors:
        if tensor.numel():
            flag = torch.maximum(flag, (~torch.isfinite(tensor)).any().float())
    for group in groups:
        if group is not None:
            comm.all_reduce(flag, group, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)
