"""Simulate a pipeline schedule from the same action lists the executor runs.

Each rank executes its list in order; an action starts when the rank is free and its input is ready:
the forward of virtual stage k needs the forward of stage k-1 (same micro-batch); the backward of stage k
needs the backward of stage k+1 and this stage's own forward. Communication costs zero. Costs are per whole
stage per micro-batch, so one of v chunks costs 1/v of it; or `action_cost(pp_rank, action)` gives each
action its own cost (the planner's per-chunk compute plus the synchronous send of its output).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from parallel.pipeline.schedules import Action, build_schedule, virtual_stage


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


def _dependencies(action: Action, stage: int, last_stage: int) -> list[tuple[str, int, int]]:
    """Keys (op, micro-batch, virtual stage) that must have finished before `action` can start."""
    if action.op == "F":
        return [("F", action.microbatch, stage - 1)] if stage > 0 else []
    deps = [("F", action.microbatch, stage)]
    if stage < last_stage:
        deps.append(("B", action.microbatch, stage + 1))
    return deps


def simulate_lists(lists: list[list[Action]], vp_size: int, num_microbatches: int,
                   forward_cost: float = 1.0, backward_cost: float = 2.0,
                   action_cost: Optional[Callable[[int, Action], float]] = None) -> Timeline:
    """Simulate per-rank action lists; raises RuntimeError if the lists deadlock.

    Without `action_cost` a forward costs forward_cost / vp and a backward backward_cost / vp. With it,
    each action on pipeline rank r costs action_cost(r, action), and `ideal` is the busiest rank's total.
    """
    p = len(lists)
    last_stage = p * vp_size - 1
    cost = {"F": forward_cost / vp_size, "B": backward_cost / vp_size}
    custom = action_cost is not None
    if not custom:
        def action_cost(_rank: int, act: Action) -> float:
            return cost[act.op]
    busy = [0.0] * p
    finished: dict[tuple[str, int, int], float] = {}
    position = [0] * p
    free_at = [0.0] * p
    events: list[Event] = []
    while any(position[r] < len(lists[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            # Run rank r as far as its inputs allow.
            while position[r] < len(lists[r]):
                action = lists[r][position[r]]
                stage = virtual_stage(r, action.chunk, p)
                deps = _dependencies(action, stage, last_stage)
                if any(d not in finished for d in deps):
                    break
                start = max([free_at[r]] + [finished[d] for d in deps])
                duration = action_cost(r, action)
                end = start + duration
                busy[r] += duration
                finished[(action.op, action.microbatch, stage)] = end
                events.append(Event(r, action, stage, start, end))
                free_at[r] = end
                position[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: lists[r][position[r]] for r in range(p) if position[r] < len(lists[r])}
            raise RuntimeError(f"schedule deadlocks: ranks wait forever at {stuck}")
    makespan = max(e.end for e in events) if events else 0.0
    ideal = num_microbatches * (forward_cost + backward_cost) if not custom else max(busy)
    return Timeline(events, p, vp_size, num_microbatches, makespan, ideal)


def simulate(schedule: str, pp_size: int, num_microbatches: int, vp_size: int = 1,
             forward_cost: float = 1.0, backward_cost: float = 2.0) -> Timeline:
    """Build every rank's list for `schedule` and simulate it."""
    lists = [build_schedule(schedule, pp_size, r, num_microbatches, vp_size) for r in range(pp_size)]
    return simulate_lists(lists, vp_size, num_microbatches, forward_cost, backward_cost)
