"""`GradientSync`: what the training step and the gradient helpers call on data parallelism, whichever flavour
the run holds: `parallel.data_parallel.DataParallel` (gradient buckets over whole parameters, all-reduced or,
with the distributed optimizer, reduce-scattered into dp shards) or `parallel.fsdp.ShardedDataParallel`
(FSDP2's sharded parameters and reduce-scattered gradient shards).

One iteration calls them in this order: `zero_grad`, then `enable_grad_sync(chunk)` just before each chunk's
last backward (the executor's `on_last_backward`), `finish_grad_sync` after the schedule, then
`owned_main_grad(param)` for the reductions over the model-parallel groups (parallel/grad_utils.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class GradientSync(Protocol):
    """The data-parallel flavour as the step sees it (module docstring)."""

    def zero_grad(self) -> None:
        """Drop the last iteration's gradients; the next backward accumulates from zero."""

    def enable_grad_sync(self, chunk_index: int = 0) -> None:
        """Called just before the last micro-batch's backward of chunk `chunk_index`: reductions may start."""

    def finish_grad_sync(self) -> None:
        """Complete every dp reduction; afterwards `owned_main_grad` holds reduced gradients."""

    def owned_main_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The flat fp32 part of `param`'s gradient this rank holds reduced after `finish_grad_sync` (maybe
        empty): what the model-parallel reductions and the optimizer work on."""
        ...

    def grad_buffer_bytes(self) -> int:
        """Bytes of this rank's gradient storage (buffers or shards)."""
        ...
