"""The rank order, declared once: global ranks as a grid of parallel dimensions (no torch).

Megatron-LM's order: tp varies fastest, then cp (context parallelism), then dp, then pp,

    rank = tp_rank + tp_size * (cp_rank + cp_size * (dp_rank + dp_size * pp_rank))

so a tp group is consecutive ranks (one node's NVLink domain on a GPU cluster), a cp group strides by tp_size,
a dp group by tp_size * cp_size and a pp group by tp_size * cp_size * dp_size (with cp = 1 this is Megatron's
tp, dp, pp order). parallel/state.py builds its process groups from this grid and planner/costs.py reads from
it how many members of a group share a node. A new dimension is one more name in MEGATRON_ORDER.

The experts of an MoE layer see the same ranks as another grid (megatron-core's expert rank generator):
tp fastest, then ep, then expert_dp, then pp, with ep x expert_dp = cp x dp, so

    rank = tp_rank + tp_size * (ep_rank + ep_size * (expert_dp_rank + expert_dp_size * pp_rank))

an ep group is ep consecutive members of one dp x cp group (stride tp), an expert-dp group strides by
tp_size * ep_size, and the tp and pp groups are those of the dense grid (`RankGrid.experts`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

MEGATRON_ORDER = ("tp", "cp", "dp", "pp")  # fastest-varying first
EXPERT_ORDER = ("tp", "ep", "expert_dp", "pp")  # the experts' view of the same ranks (module docstring)


@dataclass(frozen=True)
class RankGrid:
    """Sizes of the parallel dimensions, fastest-varying first; every method is pure arithmetic."""

    dims: tuple[tuple[str, int], ...]  # (name, size)

    @classmethod
    def megatron(cls, **sizes: int) -> RankGrid:
        """The grid in MEGATRON_ORDER; a dimension not given has size 1 (`RankGrid.megatron(tp=2, pp=4)`)."""
        unknown = sorted(set(sizes) - set(MEGATRON_ORDER))
        if unknown:
            raise ValueError(f"unknown parallel dimension {unknown[0]!r}: not one of {', '.join(MEGATRON_ORDER)}")
        return cls(tuple((name, sizes.get(name, 1)) for name in MEGATRON_ORDER))

    @classmethod
    def of(cls, layout: object) -> RankGrid:
        """The grid of anything with a `<dim>_size` attribute for every dimension of MEGATRON_ORDER
        (parallel.layout.Layout, ParallelState)."""
        return cls(tuple((name, int(getattr(layout, f"{name}_size"))) for name in MEGATRON_ORDER))

    def experts(self, ep_size: int) -> RankGrid:
        """The experts' grid of this (MEGATRON_ORDER) grid with `ep_size` expert-parallel ranks: EXPERT_ORDER
        with expert_dp = cp x dp / ep (ValueError unless ep divides cp x dp)."""
        dp_cp = self.size("cp") * self.size("dp")
        if ep_size < 1 or dp_cp % ep_size:
            raise ValueError(f"parallel.ep_size={ep_size} does not divide dp x cp = {dp_cp}")
        sizes = {"tp": self.size("tp"), "ep": ep_size, "expert_dp": dp_cp // ep_size, "pp": self.size("pp")}
        return RankGrid(tuple((name, sizes[name]) for name in EXPERT_ORDER))

    @property
    def world_size(self) -> int:
        total = 1
        for _, size in self.dims:
            total *= size
        return total

    def size(self, dim: str) -> int:
        return dict(self.dims)[dim]

    def stride(self, dim: str) -> int:
        """Distance in rank between neighbours along `dim`: the product of the faster dimensions' sizes."""
        stride = 1
        for name, size in self.dims:
            if name == dim:
                return stride
            stride *= size
        raise KeyError(dim)

    def coord(self, rank: int, dim: str) -> int:
        """This rank's index along `dim` (its tp_rank, dp_rank, ...)."""
        return (rank // self.stride(dim)) % self.size(dim)

    def rank_of(self, **coords: int) -> int:
        """The global rank at these coordinates (a dimension not given: index 0)."""
        return sum(coords.get(name, 0) * self.stride(name) for name, _ in self.dims)

    def group(self, rank: int, *dims: str) -> list[int]:
        """Ranks that differ from `rank` only along `dims` (its tp group for "tp", its model-parallel group
        for "tp", "pp"), ascending."""
        base = rank - sum(self.coord(rank, d) * self.stride(d) for d in dims)
        steps = [[i * self.stride(d) for i in range(self.size(d))] for d in dims]
        return sorted(base + sum(offsets) for offsets in itertools.product(*steps))

    def groups(self, *dims: str) -> list[list[int]]:
        """Every group along `dims`, ordered by their first member (the order all ranks create them in)."""
        others = [(name, size) for name, size in self.dims if name not in dims]
        offsets = itertools.product(*([i * self.stride(name) for i in range(size)] for name, size in others))
        return [self.group(first, *dims) for first in sorted(sum(o) for o in offsets)]

    def per_node(self, gpus_per_node: int, *dims: str) -> int:
        """Members of a group along `dims` that share a node of `gpus_per_node` consecutive ranks: the fewest
        any group has on the node of its first member (a ring over the group crosses nodes in blocks this big)."""
        return min(
            sum(1 for r in group if r // gpus_per_node == group[0] // gpus_per_node) for group in self.groups(*dims)
        )

    def crosses_nodes(self, dim: str, gpus_per_node: int) -> bool:
        """Whether some `dim` group has members on two nodes."""
        return any(group[0] // gpus_per_node != group[-1] // gpus_per_node for group in self.groups(dim))
