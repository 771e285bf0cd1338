"""A rank's pipeline plan: its action list and its communication steps, built once per run.

The steps come from `p2p.plan_steps`, a joint replay of every pipeline rank's list (so receives are posted
in the sender's order). That replay costs O(pp * actions) Python work (34 ms at p16 m128 v2), and the lists
never change during a run, so `StepContext` builds the train plan and the evaluation plan once and the
executor only walks them.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.layout import check_schedule, uses_v_shape
from parallel.pipeline.p2p import Step, needed_message, plan_steps
from parallel.pipeline.schedules import Action, Op, build_forward_only, build_schedule, unhandled_op


@dataclass(frozen=True)
class PipelinePlan:
    """What the executor runs on one rank for one iteration (or one evaluation batch)."""

    actions: tuple[Action, ...]  # this rank's ordered actions
    steps: tuple[Step, ...]  # batches of sends/receives, each followed by at most one action
    forward_only: bool  # evaluation: forwards under no_grad, nothing held for backward
    last_backward_indices: frozenset[int]  # each chunk's last action making weight grads (dp reduction starts)
    needs_own_batch: frozenset[int]  # steps whose action needs a tensor received by the step's own batch
    v_shape: bool = False  # the V-shaped chunk placement of zb-v (stages.py)


def _last_backward_indices(actions: list[Action]) -> frozenset[int]:
    """Index of each chunk's last backward (or weight-gradient, when the schedule splits them): the action
    that completes the chunk's weight gradients."""
    last: dict[int, int] = {}
    for index, action in enumerate(actions):
        match action.op:
            case Op.FORWARD | Op.BACKWARD_INPUT:
                pass
            case Op.BACKWARD | Op.WEIGHT:
                last[action.chunk] = index
            case _:
                unhandled_op(action.op)
    return frozenset(last.values())


def steps_needing_own_batch(
    steps: list[Step], actions: list[Action], pp_rank: int, pp_size: int, vp_size: int, v_shape: bool = False
) -> frozenset[int]:
    """Indices of the steps whose action needs a message that the same step receives: only those must wait
    for their batch before computing; any other step's batch can stay in flight meanwhile (overlap)."""
    found: set[int] = set()
    for index, step in enumerate(steps):
        if step.compute is None:
            continue
        need = needed_message(actions[step.compute], pp_rank, pp_size, vp_size, v_shape)
        if need is not None and any(kind == "recv" and message == need[1] for kind, _, message in step.ops):
            found.add(index)
    return frozenset(found)


def build_plan(
    schedule: str, pp_size: int, pp_rank: int, num_microbatches: int, vp_size: int = 1, forward_only: bool = False
) -> PipelinePlan:
    """This rank's plan: every rank's list of `schedule` (or the forward-only order), jointly planned."""
    v_shape = uses_v_shape(check_schedule(schedule, pp_size, vp_size, num_microbatches))
    if forward_only:
        lists = [build_forward_only(pp_size, r, num_microbatches, vp_size) for r in range(pp_size)]
    else:
        lists = [build_schedule(schedule, pp_size, r, num_microbatches, vp_size) for r in range(pp_size)]
    actions = lists[pp_rank]
    steps = plan_steps(lists, vp_size, v_shape)[pp_rank]
    return PipelinePlan(
        tuple(actions),
        tuple(steps),
        forward_only,
        _last_backward_indices(actions),
        steps_needing_own_batch(steps, actions, pp_rank, pp_size, vp_size, v_shape),
        v_shape,
    )
