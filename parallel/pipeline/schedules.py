"""Pipeline schedules as data: each rank's ordered list of forward / backward actions.

A schedule is a pure function `(schedule, pp_size, pp_rank, num_microbatches, vp_size) -> list[Action]`.
Every rank can therefore rebuild every other rank's list, which is how the executor knows in which order
a peer sends its messages (see `p2p.incoming_order`), and how the simulator and the timeline tool read
exactly what the executor runs.

Virtual stages: with `v` model chunks per rank, chunk `c` on pipeline rank `r` is virtual stage `c*p + r`
(Megatron's interleaving: rank 0 holds stages 0, p, 2p, ...). A forward output of virtual stage k goes to
k+1, a backward input-gradient to k-1. Virtual stage 0 takes no activation input; the last one,
`p*v - 1` (rank p-1, chunk v-1), computes the loss.
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work on one rank: forward ("F") or backward ("B") of a micro-batch on a chunk."""

    op: str  # "F" (forward) or "B" (backward)
    microbatch: int
    chunk: int  # model chunk index on this rank, 0..vp_size-1


class RankSchedule(list):
    """A rank's action list (a plain `list[Action]`) that remembers how it was built.

    The executor uses the recorded layout to rebuild the peers' lists and so post its receives in the
    order the peers post their sends (NCCL matches point-to-point messages by order, not by tag).
    """

    def __init__(self, actions, name: str, pp_size: int, num_microbatches: int, vp_size: int):
        super().__init__(actions)
        self.name = name
        self.pp_size = pp_size
        self.num_microbatches = num_microbatches
        self.vp_size = vp_size

    def for_rank(self, pp_rank: int) -> "RankSchedule":
        """The list the same schedule gives pipeline rank `pp_rank`."""
        if self.name == "forward_only":
            return build_forward_only(self.pp_size, pp_rank, self.num_microbatches, self.vp_size)
        return build_schedule(self.name, self.pp_size, pp_rank, self.num_microbatches, self.vp_size)


def virtual_stage(pp_rank: int, chunk: int, pp_size: int) -> int:
    """Virtual stage of chunk `chunk` on pipeline rank `pp_rank`: c*p + r."""
    return chunk * pp_size + pp_rank


def validate_schedule(schedule: str, pp_size: int, num_microbatches: int, vp_size: int) -> None:
    """Raise ValueError (one line naming the values) when the layout cannot run this schedule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.schedule={schedule!r} is unknown: use one of {', '.join(SCHEDULES)}")
    if pp_size < 1 or vp_size < 1 or num_microbatches < 1:
        raise ValueError(f"parallel.pp_size ({pp_size}), parallel.vp_size ({vp_size}) and the number of "
                         f"micro-batches ({num_microbatches}) must all be >= 1")
    if vp_size > 1 and schedule != "interleaved":
        raise ValueError(f"parallel.vp_size={vp_size} needs parallel.schedule=interleaved "
                         f"(got parallel.schedule={schedule})")
    if schedule == "interleaved" and num_microbatches % pp_size != 0:
        valid = ", ".join(str(pp_size * i) for i in range(1, 4))
        raise ValueError(f"parallel.schedule=interleaved needs the number of micro-batches "
                         f"({num_microbatches}) to be a multiple of parallel.pp_size ({pp_size}): "
                         f"use {valid}, ...")


def build_schedule(schedule: str, pp_size: int, pp_rank: int, num_microbatches: int,
                   vp_size: int = 1) -> RankSchedule:
    """This rank's ordered actions for one training iteration (validated first)."""
    validate_schedule(schedule, pp_size, num_microbatches, vp_size)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} is outside 0..{pp_size - 1}")
    if pp_size == 1 and vp_size == 1:
        # One stage: every schedule is forward then backward per micro-batch (least memory).
        actions = [a for i in range(num_microbatches) for a in (Action("F", i, 0), Action("B", i, 0))]
    elif schedule == "gpipe":
        actions = _gpipe(num_microbatches)
    elif schedule == "1f1b":
        actions = _one_f_one_b(pp_size, pp_rank, num_microbatches)
    else:
        actions = _interleaved(pp_size, pp_rank, num_microbatches, vp_size)
    return RankSchedule(actions, schedule, pp_size, num_microbatches, vp_size)


def build_forward_only(pp_size: int, pp_rank: int, num_microbatches: int, vp_size: int = 1) -> RankSchedule:
    """Evaluation order: for each micro-batch, each chunk in virtual-stage order; forwards only.

    Deadlock-free: every rank walks (micro-batch, chunk) in the same lexicographic order and each
    forward depends only on a forward of the same micro-batch at a lower virtual stage.
    """
    actions = [Action("F", i, c) for i in range(num_microbatches) for c in range(vp_size)]
    return RankSchedule(actions, "forward_only", pp_size, num_microbatches, vp_size)


def _gpipe(m: int) -> list[Action]:
    """GPipe: all forwards, then all backwards (in micro-batch order); holds m micro-batches."""
    return [Action("F", i, 0) for i in range(m)] + [Action("B", i, 0) for i in range(m)]


def _one_f_one_b(p: int, r: int, m: int) -> list[Action]:
    """PipeDream-Flush (1F1B): at most p - r micro-batches in flight on rank r."""
    warmup = min(p - r - 1, m)
    # Warm-up: fill the pipeline below this rank.
    actions = [Action("F", i, 0) for i in range(warmup)]
    # Steady state: one forward, then the backward of the oldest micro-batch in flight.
    for i in range(m - warmup):
        actions += [Action("F", warmup + i, 0), Action("B", i, 0)]
    # Cool-down: drain the backwards left.
    actions += [Action("B", i, 0) for i in range(m - warmup, m)]
    return actions


def _interleaved(p: int, r: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B over m*v virtual micro-batches k (m a multiple of p).

    Virtual micro-batch k runs on forward chunk (k // p) % v and backward chunk v - 1 - (k // p) % v,
    micro-batch (k // (p*v)) * p + k % p: groups of p micro-batches per chunk, as in Megatron.
    """
    total = m * v
    warmup = min(2 * (p - r - 1) + (v - 1) * p, total)

    def action(op: str, k: int) -> Action:
        group_chunk = (k // p) % v
        chunk = group_chunk if op == "F" else v - 1 - group_chunk
        return Action(op, (k // (p * v)) * p + k % p, chunk)

    # Warm-up: forwards until this rank's first backward can start.
    actions = [action("F", k) for k in range(warmup)]
    # Steady state: forward of virtual micro-batch warmup + i, then backward of i.
    for i in range(total - warmup):
        actions += [action("F", warmup + i), action("B", i)]
    # Cool-down: the remaining backwards.
    actions += [action("B", k) for k in range(total - warmup, total)]
    return actions
