"""Simulate a pipeline schedule from the same action lists the executor runs: one simulator.

Each rank executes its list in order; an action starts when the rank is free and the message it needs is
there. Which message an action needs and which it produces are p2p.py's rules (`needed_message`,
`produced_message`); a backward's own forward ran earlier on the same rank. Costs are per whole stage per
micro-batch, so one of v chunks costs 1/v of it; or `action_cost(pp_rank, action)` gives each action its own
cost (the planner's per-chunk compute and tensor-parallel collectives).

The communication plan is optional (`comm`):
  * without it, messages are free and arrive when their producer ends: the schedule's own timeline, whose
    bubble is the textbook one ((p-1)/m, (p-1)/(v m) interleaved);
  * with it (`CommPlan`), the executor's plan of batches runs (p2p.plan_steps, the order the trainer posts
    them): a rank posts a step's batch when it has finished the previous step (action and batch); the batch
    completes `step_cost` after every op in it and its counterpart on the peer are posted (a rendezvous, as
    NCCL may do). Without overlap the action starts when its step's batch completes; with overlap it starts
    at once unless it needs a tensor that batch receives (plan.steps_needing_own_batch), as the executor does
    with overlap_p2p_comm; either way a batch completes before the rank posts the next. With free messages
    and overlap this is still slower than the schedule's own timeline wherever a rank must wait for a batch
    whose sender is late, as the executor does.
The planner (planner/predict.py) and tools/pipeline_timeline.py call `simulate`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

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


@dataclass(frozen=True)
class CommPlan:
    """The executor's communication plan for `simulate`: `step_cost` is the seconds of a step's batch on a rank
    (a number for every batch, or `step_cost(pp_rank, step)`); `steps` the plan (default: p2p.plan_steps of
    the lists, what the executor runs); `overlap` as parallel.overlap_p2p_comm."""

    step_cost: float | Callable[[int, Step], float] = 0.0
    overlap: bool = False
    steps: list[list[Step]] | None = None

    def cost(self, rank: int, step: Step) -> float:
        if not step.ops:
            return 0.0
        return self.step_cost(rank, step) if callable(self.step_cost) else self.step_cost


@dataclass
class Timeline:
    """A simulated iteration: every event, the makespan and the bubble fraction."""

    events: list[Event]
    pp_size: int
    vp_size: int
    num_microbatches: int
    makespan: float
    ideal: float  # compute time of one rank: m * (forward + backward), or the busiest rank's with action_cost
    finish: list[float] = field(default_factory=list)  # per rank: when its last step (action or batch) ended
    exposed_comm: list[float] = field(default_factory=list)  # per rank: batch transfer time it waited for

    @property
    def bubble_fraction(self) -> float:
        """Idle time of a rank divided by its ideal compute time (same on every rank)."""
        return (self.makespan - self.ideal) / self.ideal


class _Prepared(NamedTuple):
    """One step of one rank, resolved once: what it waits on, computes, receives and produces."""

    peers: tuple[tuple[int, int], ...]  # (peer rank, index of the peer's step posting the counterpart op)
    action: Action | None
    stage: int
    need: int  # id of the message the action needs, -1: none
    received: tuple[int, ...]  # ids of the messages this step's batch receives
    produced: tuple[int, int] | None  # (destination rank, message id) set at the action's end, if free or local
    own: bool  # the action needs a message of this step's own batch


class _Ranks:
    """The simulation's state: per rank its steps, position, readiness; the messages' arrival times."""

    def __init__(self, lists: list[list[Action]], vp_size: int, comm: CommPlan | None, v_shape: bool):
        self.p = len(lists)
        if comm is None:  # every action its own step, with no batch: messages are free
            self.steps = [[Step((), i) for i in range(len(actions))] for actions in lists]
        else:
            self.steps = comm.steps if comm.steps is not None else plan_steps(lists, vp_size, v_shape)
        self.comm = comm
        self.overlap = comm is None or comm.overlap
        self._ids: dict[Message, int] = {}  # messages by number: cheap to hash
        self._where = _counterpart_steps(self.steps)
        self.prepared = [self._prepare(lists, r, vp_size, v_shape) for r in range(self.p)]
        self.posted: list[dict[int, float]] = [{} for _ in range(self.p)]
        self.position, self.ready = [0] * self.p, [0.0] * self.p
        self.arrival: dict[tuple[int, int], float] = {}  # (destination rank, message id) -> when it is there
        self.busy, self.exposed = [0.0] * self.p, [0.0] * self.p

    def _prepare(self, lists: list[list[Action]], r: int, vp_size: int, v_shape: bool) -> list[_Prepared]:
        ids = self._ids
        own = steps_needing_own_batch(self.steps[r], lists[r], r, self.p, vp_size, v_shape)
        prepared = []
        for index, step in enumerate(self.steps[r]):
            peers = tuple((q, self._where[("recv" if k == "send" else "send", q, r, m)]) for k, q, m in step.ops)
            received = tuple(ids.setdefault(m, len(ids)) for k, _, m in step.ops if k == "recv")
            action, stage, need, produced = None, -1, -1, None
            if step.compute is not None:
                action = lists[r][step.compute]
                stage = virtual_stage(r, action.chunk, self.p, v_shape)
                needed = needed_message(action, r, self.p, vp_size, v_shape)
                need = -1 if needed is None else ids.setdefault(needed[1], len(ids))
                out = produced_message(action, r, self.p, vp_size, v_shape)
                if out is not None and (self.comm is None or out[0] == r):  # free, or the local turn of the V
                    produced = (out[0], ids.setdefault(out[1], len(ids)))
            prepared.append(_Prepared(peers, action, stage, need, received, produced, index in own))
        return prepared

    def advance(self, r: int, cost_of: Callable[[int, Action], float], events: list[Event]) -> bool:
        """Run rank r's next step if it can; False when it waits on a peer or a message."""
        index = self.position[r]
        step = self.prepared[r][index]
        posted, ready = self.posted, self.ready[r]
        if any(j not in posted[q] for q, j in step.peers):
            return False  # a counterpart is not posted yet
        if step.need >= 0 and (r, step.need) not in self.arrival and step.need not in step.received:
            return False  # without a plan: the producer has not run yet
        batch_cost = self.comm.cost(r, self.steps[r][index]) if self.comm is not None and step.peers else 0.0
        done = max([ready] + [posted[q][j] for q, j in step.peers]) + batch_cost
        for message in step.received:
            self.arrival[(r, message)] = done
        end = done
        waits_for_batch = step.action is None or not self.overlap or step.own
        if step.action is not None:
            start = max(done if waits_for_batch else ready, self.arrival[(r, step.need)] if step.need >= 0 else 0.0)
            duration = cost_of(r, step.action)
            end = start + duration
            self.busy[r] += duration
            events.append(Event(r, step.action, step.stage, start, end))
            if step.produced is not None:
                self.arrival[step.produced] = end
        if waits_for_batch and step.peers:
            self.exposed[r] += min(batch_cost, max(0.0, done - ready))
        self.ready[r] = max(end, done)
        self.position[r] += 1
        return True


def simulate(
    lists: list[list[Action]],
    vp_size: int,
    num_microbatches: int,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    action_cost: Callable[[int, Action], float] | None = None,
    weight_cost: float | None = None,
    v_shape: bool = False,
    comm: CommPlan | None = None,
) -> Timeline:
    """Simulate per-rank action lists, with the executor's communication plan when `comm` is given (module
    docstring); raises RuntimeError if they deadlock.

    Without `action_cost` a forward costs forward_cost / vp and a backward backward_cost / vp. With it,
    each action on pipeline rank r costs action_cost(r, action), and `ideal` is the busiest rank's total.
    """

    def cost_of(rank: int, act: Action) -> float:
        if action_cost is not None:
            return action_cost(rank, act)
        return stage_cost(act.op, forward_cost, backward_cost, vp_size, weight_cost)

    ranks, events = _Ranks(lists, vp_size, comm, v_shape), list[Event]()
    p = ranks.p
    while any(ranks.position[r] < len(ranks.steps[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while ranks.position[r] < len(ranks.steps[r]):
                index = ranks.position[r]
                if index not in ranks.posted[r]:  # posting a batch lets the peers go on
                    ranks.posted[r][index] = ranks.ready[r]
                    progressed = True
                if not ranks.advance(r, cost_of, events):
                    break
                progressed = True
        if not progressed:
            stuck = {r: ranks.steps[r][ranks.position[r]] for r in range(p) if ranks.position[r] < len(ranks.steps[r])}
            raise RuntimeError(f"schedule deadlocks: ranks wait forever at {stuck}")
    makespan = max(e.end for e in events) if events else 0.0
    ideal = max(ranks.busy) if action_cost is not None else num_microbatches * (forward_cost + backward_cost)
    return Timeline(events, p, vp_size, num_microbatches, makespan, ideal, ranks.ready, ranks.exposed)


def simulate_schedule(
    schedule: str,
    pp_size: int,
    num_microbatches: int,
    vp_size: int = 1,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    weight_cost: float | None = None,
    comm: CommPlan | None = None,
) -> Timeline:
    """Build every rank's list for `schedule` and simulate it (`stage_cost` for the costs)."""
    lists = [build_schedule(schedule, pp_size, r, num_microbatches, vp_size) for r in range(pp_size)]
    v_shape = uses_v_shape(check_schedule(schedule, pp_size, vp_size, num_microbatches))
    return simulate(
        lists,
        vp_size,
        num_microbatches,
        forward_cost,
        backward_cost,
        weight_cost=weight_cost,
        v_shape=v_shape,
        comm=comm,
    )


def _counterpart_steps(plans: list[list[Step]]) -> dict[tuple[str, int, int, Message], int]:
    """(op kind, rank, peer, message) -> index of the step of `rank` that posts that op."""
    where: dict[tuple[str, int, int, Message], int] = {}
    for rank, steps in enumerate(plans):
        for index, step in enumerate(steps):
            for kind, peer, message in step.ops:
                where[(kind, rank, peer, message)] = index
    return where
