"""One collective or one send / receive of one rank, as the planner lists it (planner/collectives.py,
planner/sharded.py) and parallel/comm.py records it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Collective:
    """One collective or one send / receive of one rank (parallel/comm.py records the same fields)."""

    kind: str  # all_reduce, all_gather, reduce_scatter, send, recv
    group: str  # tp, cp, pp, dp, dp_cp, embedding, tp_pp, world
    group_size: int
    nbytes: int  # the full buffer: an all-gather's output, a reduce-scatter's input, the tensor otherwise
