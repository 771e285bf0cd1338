"""Pipeline schedules as data: each rank's ordered list of forward / backward actions.

A schedule is a pure function `(schedule, pp_size, pp_rank, num_microbatches, vp_size) -> list[Action]`.
Every rank can therefore build every other rank's list, which is how the joint communication plan knows in
which order a peer sends its messages (`plan.build_plan` -> `p2p.plan_steps`), and how the simulator and the
timeline tool read exactly what the executor runs. Which schedules a layout may run is decided by
parallel/layout.py (`check_schedule`), the one home of the layout rules.

Virtual stages: with `v` model chunks per rank, chunk `c` on pipeline rank `r` is virtual stage `c*p + r`
(Megatron's interleaving: rank 0 holds stages 0, p, 2p, ...). A forward output of virtual stage k goes to
k+1, a backward input-gradient to k-1. Virtual stage 0 takes no activation input; the last one,
`p*v - 1` (rank p-1, chunk v-1), computes the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NoReturn

from parallel.layout import check_schedule


class Op(Enum):
    """What an action computes. Every reader dispatches on all members (`match`, with `unhandled_op` as the
    `case _:`), so a new kind of action (e.g. a deferred weight gradient) fails mypy and, at run time, fails
    loudly wherever it is not handled yet."""

    FORWARD = "F"
    BACKWARD = "B"


def unhandled_op(op: NoReturn) -> NoReturn:
    """The `case _:` of a dispatch on Op: mypy proves it unreachable when every member has a case (the contract
    of typing.assert_never, which Python 3.10 lacks); a member that has none raises here."""
    raise ValueError(f"pipeline action kind {op!r} is not handled here")


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work on one rank: forward or backward of a micro-batch on a chunk."""

    op: Op
    microbatch: int
    chunk: int  # model chunk index on this rank, 0..vp_size-1


def build_schedule(schedule: str, pp_size: int, pp_rank: int, num_microbatches: int, vp_size: int = 1) -> list[Action]:
    """This rank's ordered actions for one training iteration (layout rules checked first).

    `schedule` is resolved by parallel/layout.py's rules: "1f1b" with vp > 1 runs interleaved, any
    schedule with one stage runs forward then backward per micro-batch.
    """
    schedule = check_schedule(schedule, pp_size, vp_size, num_microbatches)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} is outside 0..{pp_size - 1}")
    if schedule == "gpipe":
        return _gpipe(num_microbatches)
    if schedule == "1f1b":  # with one stage: forward then backward per micro-batch (least memory)
        return _one_f_one_b(pp_size, pp_rank, num_microbatches)
    return _interleaved(pp_size, pp_rank, num_microbatches, vp_size)


def build_forward_only(pp_size: int, pp_rank: int, num_microbatches: int, vp_size: int = 1) -> list[Action]:
    """Evaluation order: for each micro-batch, each chunk in virtual-stage order; forwards only.

    Deadlock-free: every rank walks (micro-batch, chunk) in the same lexicographic order and each
    forward depends only on a forward of the same micro-batch at a lower virtual stage.
    """
    return [Action(Op.FORWARD, i, c) for i in range(num_microbatches) for c in range(vp_size)]


def _gpipe(m: int) -> list[Action]:
    """GPipe: all forwards, then all backwards (in micro-batch order); holds m micro-batches."""
    return [Action(Op.FORWARD, i, 0) for i in range(m)] + [Action(Op.BACKWARD, i, 0) for i in range(m)]


def _one_f_one_b(p: int, r: int, m: int) -> list[Action]:
    """PipeDream-Flush (1F1B): at most p - r micro-batches in flight on rank r."""
    warmup = min(p - r - 1, m)
    # Warm-up: fill the pipeline below this rank.
    actions = [Action(Op.FORWARD, i, 0) for i in range(warmup)]
    # Steady state: one forward, then the backward of the oldest micro-batch in flight.
    for i in range(m - warmup):
        actions += [Action(Op.FORWARD, warmup + i, 0), Action(Op.BACKWARD, i, 0)]
    # Cool-down: drain the backwards left.
    actions += [Action(Op.BACKWARD, i, 0) for i in range(m - warmup, m)]
    return actions


def _interleaved(p: int, r: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B over m*v virtual micro-batches k (m a multiple of p).

    Virtual micro-batch k runs on forward chunk (k // p) % v and backward chunk v - 1 - (k // p) % v,
    micro-batch (k // (p*v)) * p + k % p: groups of p micro-batches per chunk, as in Megatron.
    """
    total = m * v
    warmup = min(2 * (p - r - 1) + (v - 1) * p, total)

    def forward(k: int) -> Action:
        return Action(Op.FORWARD, (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k: int) -> Action:
        return Action(Op.BACKWARD, (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    # Warm-up: forwards until this rank's first backward can start.
    actions = [forward(k) for k in range(warmup)]
    # Steady state: forward of virtual micro-batch warmup + i, then backward of i.
    for i in range(total - warmup):
        actions += [forward(warmup + i), backward(i)]
    # Cool-down: the remaining backwards.
    actions += [backward(k) for k in range(total - warmup, total)]
    return actions
