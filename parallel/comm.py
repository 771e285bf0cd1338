"""Compatibility wrappers for the tensor-to-tensor collectives.

torch 2.13 deprecates `all_gather_into_tensor` / `reduce_scatter_tensor` in favour of `all_gather_single` /
`reduce_scatter_single`, while torch 2.11 (the GPU machine) may lack the new names. Everything in parallel/
calls these two functions instead of either spelling; `async_op=True` returns the work handle to wait on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_gather_into(output: torch.Tensor, input_: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Concatenate every rank's `input_` along dim 0 into `output` (world_size x input rows)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input_, group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, input_: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Sum `input_` over ranks and keep this rank's dim-0 slice (input rows / world_size) in `output`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input_, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
