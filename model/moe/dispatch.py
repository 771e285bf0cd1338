"""Expert parallelism's token dispatch: megatron-core 0.16.1's MoEAlltoAllTokenDispatcher without tensor
parallelism inside the experts.

The ep ranks of a group hold E / ep experts each, contiguous: ep rank r holds experts [r x E/ep, (r+1) x E/ep).
Each rank routes its own tokens, permutes them by expert (expert 0's first), and then

  1. sends every rank the number of its tokens for each of that rank's experts (an all-to-all of the counts),
  2. sends the permuted tokens and their routing weights to the experts' ranks (all-to-all with uneven splits:
     what arrives is grouped by source rank, and within it by local expert),
  3. regroups what arrived by local expert (megatron-core's sort_chunks_by_idxs) and runs the local experts,
  4. undoes the regrouping, sends the outputs back by the reverse all-to-all and unpermutes.

The collectives come from an `ExpertExchange` that parallel/ provides (parallel/expert_parallel.py, through the
collectives door): model/ does not import torch.distributed. Its all-to-all is differentiable (backward is
the reverse all-to-all), so the gradients of the tokens and routing weights return to the ranks that sent them
and each expert's weight gradient sums the contributions of every ep rank's tokens.

Token dropping (model.moe_expert_capacity_factor) is decided by the router on each rank's own tokens before
dispatch, as megatron-core does: an expert's capacity counts the tokens of that rank's batch, so which tokens
are dropped depends on the local batch (a different split of the same global batch can drop others).

Shapes: T local tokens, E experts, E_local = E / ep, h hidden, P = this rank's routed rows (T x k undropped),
R = the rows arriving for the local experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from model.moe.experts import permute, unpermute

# The local experts: (rows grouped by local expert [R, h], their routing weights [R], rows per local expert
# [E_local]) -> outputs [R, h] (model/moe/experts.GroupedExperts.forward).
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertExchange(Protocol):
    """What the dispatcher needs of the ep group (parallel/expert_parallel.EPExchange implements it)."""

    @property
    def ep_size(self) -> int:
        """Ranks of the ep group."""
        ...

    @property
    def ep_rank(self) -> int:
        """This rank's index in the ep group."""
        ...

    def all_to_all(self, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        """Rows of `tensor` (input_splits[j] for ep rank j, in rank order) sent, output_splits[i] rows received
        from ep rank i; differentiable (backward: the reverse all-to-all)."""
        ...


def local_expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """The global experts [start, stop) that ep rank `ep_rank` holds (num_experts divisible by ep_size)."""
    if num_experts % ep_size:
        raise ValueError(f"model.num_experts={num_experts} is not divisible by parallel.ep_size={ep_size}")
    per_rank = num_experts // ep_size
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


def _regroup(rows: torch.Tensor, sizes: list[list[int]], by_source: bool) -> torch.Tensor:
    """Reorder the chunks of `rows`: sizes[i][e] rows of (source rank i, local expert e). by_source True: rows
    come source-major (i, e) and leave expert-major (e, i); False: the inverse."""
    ranks, experts = len(sizes), len(sizes[0])
    if by_source:
        chunks = torch.split(rows, [sizes[i][e] for i in range(ranks) for e in range(experts)])
        return torch.cat([chunks[i * experts + e] for e in range(experts) for i in range(ranks)])
    chunks = torch.split(rows, [sizes[i][e] for e in range(experts) for i in range(ranks)])
    return torch.cat([chunks[e * ranks + i] for i in range(ranks) for e in range(experts)])


class AllToAllDispatcher:
    """Sends each token to the ep ranks of its experts, runs the local experts, brings the outputs back
    (module docstring). `num_experts` counts all experts of the layer."""

    def __init__(self, exchange: ExpertExchange, num_experts: int):
        self.exchange = exchange
        self.num_experts = num_experts
        self.expert_range = local_expert_range(num_experts, exchange.ep_size, exchange.ep_rank)

    @property
    def num_local_experts(self) -> int:
        """E / ep."""
        return self.expert_range[1] - self.expert_range[0]

    def __call__(
        self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, experts: LocalExperts
    ) -> torch.Tensor:
        """tokens [T, h], probs [T, E], routing_map [T, E] bool -> the weighted sum of each token's experts'
        outputs [T, h] (zeros for a token every expert dropped)."""
        ep_size, local = self.exchange.ep_size, self.num_local_experts
        permuted, permuted_probs, sorted_indices, tokens_per_expert = permute(tokens, routing_map, probs)
        # counts_in[i, e]: rows ep rank i sends to this rank's local expert e
        counts_in = self.exchange.all_to_all(tokens_per_expert, [local] * ep_size, [local] * ep_size)
        sizes = counts_in.view(ep_size, local).tolist()  # one host sync, as megatron-core's
        input_splits = tokens_per_expert.view(ep_size, local).sum(dim=1).tolist()
        output_splits = [sum(row) for row in sizes]
        received = self.exchange.all_to_all(permuted, output_splits, input_splits)  # [R, h]
        received_probs = self.exchange.all_to_all(permuted_probs, output_splits, input_splits)  # [R]
        rows_per_expert = torch.tensor([sum(row[e] for row in sizes) for e in range(local)], dtype=torch.long)
        expert_out = experts(
            _regroup(received, sizes, by_source=True),
            _regroup(received_probs, sizes, by_source=True),
            rows_per_expert.to(tokens_per_expert.device),
        )
        returned = self.exchange.all_to_all(_regroup(expert_out, sizes, by_source=False), input_splits, output_splits)
        return unpermute(returned, sorted_indices, tokens.shape[0])
