"""Expert parallelism from parallel/'s side: the ep group's all-to-all handed to the MoE layer's dispatcher
(model/moe/dispatch.py), which keeps model/ free of torch.distributed.

Which ranks form an ep group and an expert-dp group: parallel/rank_grid.py (`RankGrid.experts`) and
parallel/state.py; how expert gradients are reduced: parallel/data_parallel.py and optim/optimizer.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed import ProcessGroup

from parallel.comm import Collectives

if TYPE_CHECKING:
    from parallel.state import ParallelState


@dataclass(frozen=True)
class EPExchange:
    """model.moe.dispatch.ExpertExchange over one ep group, every call through the collectives door `comm`."""

    comm: Collectives
    group: ProcessGroup | None
    ep_rank: int
    ep_size: int

    @classmethod
    def of(cls, state: ParallelState) -> EPExchange:
        """The exchange of the state's ep group."""
        return cls(state.comm, state.ep_group, state.ep_rank, state.ep_size)

    def all_to_all(self, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        """Differentiable all-to-all over the ep group (Collectives.all_to_all)."""
        return self.comm.all_to_all(tensor, output_splits, input_splits, self.group)
