"""Simulate a pipeline schedule from the same action lists the executor runs.

Each rank executes its list in order; an action starts when the rank is free and the message it needs has
arrived. Which message an action needs and which it produces are p2p.py's rules (`needed_message`,
`produced_message`), the same the executor's communication plan follows; a backward's own forward ran
earlier on the same rank. Communication costs zero. Costs are per whole stage per micro-batch, so one of v
chunks costs 1/v of it; or `action_cost(pp_rank, action)` gives each action its own cost (the planner's
per-chunk compute plus the synchronous send of its output).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from parallel.layout import check_schedule, uses_v_shape
from parallel.pipeline.p2p import Message, Step, needed_message, plan_steps, produced_message
from parallel.pipeline.plan import steps_needing_own_batch
from parallel.pipeline.schedules import Action, Op, build_schedule, unhandled_op
from parallel.pipeline.stages import virtual_stage


def stage_cost(
    op: Op, forward_cost: float, backward_cost: float, vp_size: int, weight_cost: float | None = None
) -> float:
    """The cost of one action of kind `op` on one of vp_size chunks (costs are per whole stage).

    `backward_cost` is the whole backward (input and weight gradients), `weight_cost` the part of it that a
    WEIGHT action computes (default: half, the weight GEMMs' share of a backward); a BACKWARD_INPUT costs the
    rest.
    """
    weight = backward_cost / 2 if weight_cost is None else weight_cost
    match op:
        case Op.FORWARD:
            return forward_cost / vp_size
        case Op.BACKWARD:
            return backward_cost / vp_size
        case Op.BACKWARD_INPUT:
            return (backward_cost - weight) / vp_size
        case Op.WEIGHT:
            return weight / vp_size
        case _:
            unhandled_op(op)


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


# Twin of simulate_plans' signature: both simulate the same action lists at the same stage costs (this one
# without the communication plan), so their leading arguments stay alike.
def simulate_lists(
    lists: list[list[Action]],
    vp_size: int,
    num_microbatches: int,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    action_cost: Callable[[int, Action], float] | None = None,
    weight_cost: float | None = None,
    v_shape: bool = False,
) -> Timeline:
    """Simulate per-rank action lists; raises RuntimeError if the lists deadlock.

    Without `action_cost` a forward costs forward_cost / vp and a backward backward_cost / vp. With it,
    each action on pipeline rank r costs action_cost(r, action), and `ideal` is the busiest rank's total.
    """
    p = len(lists)
    custom = action_cost is not None

    def cost_of(rank: int, act: Action) -> float:
        if action_cost is not None:
            return action_cost(rank, act)
        return stage_cost(act.op, forward_cost, backward_cost, vp_size, weight_cost)

    busy = [0.0] * p
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
                need = needed_message(action, r, p, vp_size, v_shape)
                if need is not None and need[1] not in arrived:
                    break
                start = max(free_at[r], arrived[need[1]] if need is not None else 0.0)
                duration = cost_of(r, action)
                end = start + duration
                busy[r] += duration
                out = produced_message(action, r, p, vp_size, v_shape)
                if out is not None:
                    arrived[out[1]] = end
                events.append(Event(r, action, virtual_stage(r, action.chunk, p, v_shape), start, end))
                free_at[r] = end
                position[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: lists[r][position[r]] for r in range(p) if position[r] < len(lists[r])}
            raise RuntimeError(f"schedule deadlocks: ranks wait forever at {stuck}")
    makespan = max(e.end for e in events) if events else 0.0
    ideal = max(busy) if custom else num_microbatches * (forward_cost + backward_cost)
    return Timeline(events, p, vp_size, num_microbatches, makespan, ideal)


def simulate(
    schedule: str,
    pp_size: int,
    num_microbatches: int,
    vp_size: int = 1,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    weight_cost: float | None = None,
) -> Timeline:
    """Build every rank's list for `schedule` and simulate it (`stage_cost` for the costs)."""
    lists = [build_schedule(schedule, pp_size, r, num_microbatches, vp_size) for r in range(pp_size)]
    v_shape = uses_v_shape(check_schedule(schedule, pp_size, vp_size, num_microbatches))
    return simulate_lists(
        lists, vp_size, num_microbatches, forward_cost, backward_cost, weight_cost=weight_cost, v_shape=v_shape
    )


def _counterpart_steps(plans: list[list[Step]]) -> dict[tuple[str, int, int, Message], int]:
    """(op kind, rank, peer, message) -> index of the step of `rank` that posts that op."""
    where: dict[tuple[str, int, int, Message], int] = {}
    for rank, steps in enumerate(plans):
        for index, step in enumerate(steps):
            for kind, peer, message in step.ops:
                where[(kind, rank, peer, message)] = index
    return where


# Twin of simulate_lists' signature (same lists and stage costs), plus the communication plan's costs.
def simulate_plans(
    lists: list[list[Action]],
    vp_size: int,
    num_microbatches: int,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    comm_cost: float = 0.0,
    overlap: bool = False,
    weight_cost: float | None = None,
    v_shape: bool = False,
) -> Timeline:
    """Simulate the executor running the joint communication plan of `lists` (p2p.plan_steps).

    A rank posts its step's batch when it has finished the previous step (action and batch); the batch
    completes `comm_cost` after every op in it and its counterpart on the peer are posted (a rendezvous,
    as NCCL may do). Without overlap the action starts when its step's batch completes; with overlap it
    starts at once unless it needs a tensor that batch receives (plan.steps_needing_own_batch), as the
    executor does with overlap_p2p_comm.
    """
    p = len(lists)
    plans = plan_steps(lists, vp_size, v_shape)
    own = [steps_needing_own_batch(plans[r], lists[r], r, p, vp_size, v_shape) for r in range(p)]
    where = _counterpart_steps(plans)
    posted: list[dict[int, float]] = [{} for _ in range(p)]
    position, ready = [0] * p, [0.0] * p  # next step of each rank; when it can post that step's batch
    events: list[Event] = []
    while any(position[r] < len(plans[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(plans[r]):
                index, step = position[r], plans[r][position[r]]
                progressed |= index not in posted[r]
                posted[r][index] = ready[r]
                peers = [
                    (peer, where[("recv" if kind == "send" else "send", peer, r, message)])
                    for kind, peer, message in step.ops
                ]
                if any(j not in posted[q] for q, j in peers):
                    break  # a counterpart is not posted yet
                done = max([ready[r]] + [posted[q][j] for q, j in peers]) + (comm_cost if step.ops else 0.0)
                end = done
                if step.compute is not None:
                    action = lists[r][step.compute]
                    start = done if not overlap or index in own[r] else ready[r]
                    end = start + stage_cost(action.op, forward_cost, backward_cost, vp_size, weight_cost)
                    events.append(Event(r, action, virtual_stage(r, action.chunk, p, v_shape), start, end))
                ready[r] = max(end, done)
                position[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline plan deadlocks")
    makespan = max(e.end for e in events) if events else 0.0
    return Timeline(events, p, vp_size, num_microbatches, makespan, num_microbatches * (forward_cost + backward_cost))
