"""Simulate a pipeline schedule from the same action lists the executor runs.

Each rank executes its list in order; an action starts when the rank is free and the message it needs has
arrived. Which message an action needs and which it produces are p2p.py's rules (`needed_message`,
`produced_message`), the same the executor's communication plan follows; a backward's own forward ran
earlier on the same rank. Communication costs zero. Costs are per whole stage per micro-batch, so one of v
chunks costs 1/v of it.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallel.pipeline.p2p import Message, needed_message, produced_message
from parallel.pipeline.schedules import Action, build_schedule
from parallel.pipeline.stages import virtual_stage


@dataclass(frozen=True)
class Event:
    """One executed action on the simulated timeline."""

    rank: int
    action: Action
    stage: int  # virtual stage
    start: float
    end: float


@dataclass
class Timeline:
    """A simulated iteration: every event, the makespan and the bubble fraction."""

    events: list[Event]
    pp_size: int
    vp_size: int
    num_microbatches: int
    makespan: float
    ideal: float  # compute time of one rank: m * (forward + backward)

    @property
    def bubble_fraction(self) -> float:
        """Idle time of a rank divided by its ideal compute time (same on every rank)."""
        return (self.makespan - self.ideal) / self.ideal


def simulate_lists(lists: list[list[Action]], vp_size: int, num_microbatches: int,
                   forward_cost: float = 1.0, backward_cost: float = 2.0) -> Timeline:
    """Simulate per-rank action lists; raises RuntimeError if the lists deadlock."""
    p = len(lists)
    cost = {"F": forward_cost / vp_size, "B": backward_cost / vp_size}
    arrived: dict[Message, float] = {}  # message -> time it is available at its destination
    position = [0] * p
    free_at = [0.0] * p
    events: list[Event] = []
    while any(position[r] < len(lists[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            # Run rank r as far as its inputs allow.
            while position[r] < len(lists[r]):
                action = lists[r][position[r]]
                need = needed_message(action, r, p, vp_size)
                if need is not None and need[1] not in arrived:
                    break
                start = max(free_at[r], arrived[need[1]] if need is not None else 0.0)
                end = start + cost[action.op]
                out = produced_message(action, r, p, vp_size)
                if out is not None:
                    arrived[out[1]] = end
                events.append(Event(r, action, virtual_stage(r, action.chunk, p), start, end))
                free_at[r] = end
                position[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: lists[r][position[r]] for r in range(p) if position[r] < len(lists[r])}
            raise RuntimeError(f"schedule deadlocks: ranks wait forever at {stuck}")
    makespan = max(e.end for e in events) if events else 0.0
    return Timeline(events, p, vp_size, num_microbatches, makespan,
                    num_microbatches * (forward_cost + backward_cost))


def simulate(schedule: str, pp_size: int, num_microbatches: int, vp_size: int = 1,
             forward_cost: float = 1.0, backward_cost: float = 2.0) -> Timeline:
    """Build every rank's list for `schedule` and simulate it."""
    lists = [build_schedule(schedule, pp_size, r, num_microbatches, vp_size) for r in range(pp_size)]
    return simulate_lists(lists, vp_size, num_microbatches, forward_cost, backward_cost)
