"""AdamW on FSDP's sharded parameters (parallel/fsdp.py): the optimizer of the third data-parallel flavour.

Each rank holds a shard of every parameter (FSDP's fp32 sharded parameter: the master weight) and, after
backward, the fp32 reduce-scattered gradient of that shard. One segment per parameter: `master` is a view of
the shard itself (no copy, nothing to write back; FSDP casts it for the next all-gather), `grad` the gradient
shard (FSDP allocates it each backward, so it is bound at every step), the Adam moments are this optimizer's.
Everything else is the step of the shared base, optim/optimizer.Optimizer: unscale and the inf/NaN check over
the world (fp16 skips the step), the global grad norm (each element counted once: tp-replicated parameters on
tp rank 0, summed over tp x pp and over the shard group, not over HSDP's replicas, which hold the same shard),
clipping, the same AdamW arithmetic on each element. Checkpoint pieces: `pieces` says where each shard lies in the
parameter (parallel/fsdp.local_shard), so checkpoint/state.py stores it in global coordinates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from config.schema import OptimConfig, TrainConfig
from optim.optimizer import Optimizer, OptimizerState, Segment, StepStats, _runs, check_optimizer_inputs, decays
from parallel.fsdp import ShardedDataParallel, local_shard, local_tensor
from parallel.grad_utils import counts_in_grad_norm

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from parallel.state import ParallelState


class ShardedOptimizer(Optimizer):
    """AdamW over the FSDP shards of `ddp` (a ShardedDataParallel); see the module docstring."""

    def __init__(self, ddp: ShardedDataParallel, state: ParallelState, optim: OptimConfig, train: TrainConfig):
        self.fsdp = ddp  # read by _build_segments, which the base constructor calls
        super().__init__(state, optim, train)

    def _alias_params(self, precision: str) -> bool:
        """In every precision: FSDP keeps the fp32 shards and casts them for compute, and each segment's master
        is a view of the sharded parameter itself (nothing to do)."""
        return True

    def _build_segments(self) -> list[Segment]:
        segments = []
        tp_rank = self.state.tp_rank
        for param in self.fsdp.params:
            shard = local_shard(param)
            length = shard.flat.numel()
            if not length:  # a parameter with fewer rows than shard ranks: this rank holds none of it
                continue
            pieces = [(param, 0, shard.start, length)]
            segments.append(
                Segment(
                    None,
                    0,
                    length,
                    torch.zeros(0, device=shard.flat.device),  # bound to FSDP's gradient shard at each step
                    shard.flat,  # the fp32 sharded parameter is the master
                    torch.zeros_like(shard.flat),
                    torch.zeros_like(shard.flat),
                    pieces,
                    decay_runs=_runs(pieces, decays),
                    norm_runs=_runs(pieces, lambda p: counts_in_grad_norm(p, tp_rank)),
                )
            )
        return segments

    def _norm_groups(self) -> list[ProcessGroup | None]:
        return [self.state.model_parallel_group, self.fsdp.shard_group] if self.state.is_distributed else []

    def _bind_grads(self) -> None:
        for seg in self.segments:
            param = seg.pieces[0][0]
            if param.grad is None:
                raise RuntimeError("the optimizer stepped before ShardedDataParallel.finish_grad_sync")
            seg.grad = local_tensor(param.grad).view(-1)

    @torch.no_grad()
    def step(self, lr: float | None = None) -> StepStats:
        self._bind_grads()
        return super().step(lr)

    @torch.no_grad()
    def reset_from_params(self) -> None:
        """Fresh state after loading weights only: the masters are the loaded shards already."""
        for seg in self.segments:
            seg.exp_avg.zero_()
            seg.exp_avg_sq.zero_()
        self.step_count = 0

    def state_dict(self) -> OptimizerState:
        raise ValueError(
            "the per-rank optimizer format of earlier versions has no FSDP shards: checkpoints of an FSDP run are "
            "written in the layout-free format (checkpoint/)"
        )

    def load_state_dict(self, state: OptimizerState) -> None:
        raise ValueError(
            "a checkpoint in the per-rank format of earlier versions loads only at its own layout, without "
            "parallel.fsdp: resume it without FSDP once (the next save is layout-free), then with FSDP"
        )


def build_sharded_optimizer(
    chunks: list[torch.nn.Module],
    ddp: ShardedDataParallel,
    state: ParallelState,
    optim: OptimConfig,
    train: TrainConfig,
) -> ShardedOptimizer:
    """optim/optimizer.build_optimizer's twin for FSDP: the same settings (the optim and train sections)."""
    check_optimizer_inputs(chunks, ddp.chunks, train, "build_sharded_optimizer")
    return ShardedOptimizer(ddp, state, optim, train)
