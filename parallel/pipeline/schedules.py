"""Pipeline schedules as data: each rank's ordered list of forward / backward actions.

A schedule is a pure function `(schedule, pp_size, pp_rank, num_microbatches, vp_size) -> list[Action]`.
Every rank can therefore build every other rank's list, which is how the joint communication plan knows in
which order a peer sends its messages (`plan.build_plan` -> `p2p.plan_steps`), and how the simulator and the
timeline tool read exactly what the executor runs. Which schedules a layout may run is decided by
parallel/layout.py (`check_schedule`), the one home of the layout rules.

Virtual stages: with `v` model chunks per rank, chunk `c` on pipeline rank `r` is virtual stage `c*p + r`
(Megatron's interleaving: rank 0 holds stages 0, p, 2p, ...); zb-v places its two chunks in a V instead
(stages.py). A forward output of virtual stage k goes to
k+1, a backward input-gradient to k-1. Virtual stage 0 takes no activation input; the last one,
`p*v - 1` (rank p-1, chunk v-1; rank 0 under zb-v), computes the loss.

Zero bubble (Qi et al., ICLR 2024): zb-h1 and zb-v split each backward into BACKWARD_INPUT (the input
gradient, on the critical path: the previous stage waits for it) and WEIGHT (the weight gradients, which
nobody waits for and which therefore fill the bubbles). A micro-batch's activations stay until its WEIGHT.
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
    BACKWARD = "B"  # the whole backward: input and weight gradients (gpipe, 1f1b, interleaved)
    BACKWARD_INPUT = "I"  # input gradient only, weight gradients deferred (zero-bubble schedules)
    WEIGHT = "W"  # the deferred weight gradients of one micro-batch and chunk


def unhandled_op(op: NoReturn) -> NoReturn:
    """The `case _:` of a dispatch on Op: mypy proves it unreachable when every member has a case (the contract
    of typing.assert_never, which Python 3.10 lacks); a member that has none raises here."""
    raise ValueError(f"pipeline action kind {op!r} is not handled here")


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work on one rank: forward, backward (whole, input part or weight part) of a
    micro-batch on a chunk."""

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
    if schedule == "zb-h1":
        return _zb_h1(pp_size, pp_rank, num_microbatches)
    if schedule == "zb-v":
        return _zb_v(pp_size, pp_rank, num_microbatches)
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


def _zb_h1(p: int, r: int, m: int) -> list[Action]:
    """ZB-H1: 1F1B's order of forwards and input-gradients, with rank r's weight-gradients running r
    steps late; the deferred ones fill the cool-down, where 1F1B waits for the gradients coming back.

    With tF = tB = tW the bubble is (p-1)(tF + tB - tW) against 1F1B's (p-1)(tF + tB + tW) (m >= p); every
    rank holds at most p micro-batches (1F1B's rank 0), since rank r starts with p-1-r forwards and runs
    its first weight-gradient r steps after its first input-gradient.
    """
    warmup = min(p - r - 1, m)
    actions = [Action(Op.FORWARD, i, 0) for i in range(warmup)]
    weights = 0  # weight-gradients issued so far (in micro-batch order)
    for i in range(m - warmup):  # steady state: F, I, and from step r on the oldest pending W
        actions += [Action(Op.FORWARD, warmup + i, 0), Action(Op.BACKWARD_INPUT, i, 0)]
        if i >= r:
            actions.append(Action(Op.WEIGHT, weights, 0))
            weights += 1
    for i in range(m - warmup, m):  # cool-down: each input-gradient followed by one deferred W
        actions += [Action(Op.BACKWARD_INPUT, i, 0), Action(Op.WEIGHT, weights, 0)]
        weights += 1
    return actions + [Action(Op.WEIGHT, i, 0) for i in range(weights, m)]


def _zb_v(p: int, r: int, m: int) -> list[Action]:
    """ZB-V (vp = 2, V-shaped: rank r holds virtual stages r and 2p-1-r, stages.py).

    Warm-up: forwards of chunk 0 (2(p-r)-1 of them), then alternate chunk 1 and chunk 0, then p-r rounds of
    chunk 1's F, I, W. Steady state: F, I, W on chunk 0, then on chunk 1. Cool-down: the input-gradients
    left, alternating chunks, then the deferred weight-gradients. At most 2p chunk forwards (p whole
    micro-batches, 1F1B's peak) are held on a rank. The order follows torch.distributed.pipelining's ZBV,
    without its padding to 2p - 1 micro-batches; simulated, its bubble is at most ZB-H1's (tests).
    """
    count = {op: [0, 0] for op in Op}  # actions issued per (op, chunk): the next micro-batch of each
    actions: list[Action] = []

    def issue(op: Op, chunk: int, limit: int) -> None:
        if count[op][chunk] < limit:
            actions.append(Action(op, count[op][chunk], chunk))
            count[op][chunk] += 1

    def forward_input_weight(chunk: int) -> None:
        issue(Op.FORWARD, chunk, m if chunk == 0 else count[Op.FORWARD][0])
        issue(Op.BACKWARD_INPUT, chunk, count[Op.FORWARD][chunk])
        issue(Op.WEIGHT, chunk, count[Op.BACKWARD_INPUT][chunk])

    for _ in range(2 * (p - r) - 1):
        issue(Op.FORWARD, 0, m)
    for _ in range(r):
        issue(Op.FORWARD, 1, count[Op.FORWARD][0])
        issue(Op.FORWARD, 0, m)
    for _ in range(p - r):
        forward_input_weight(1)
    while count[Op.FORWARD][0] < m or count[Op.FORWARD][1] < m:
        forward_input_weight(0)
        forward_input_weight(1)
    while count[Op.BACKWARD_INPUT][0] < m or count[Op.BACKWARD_INPUT][1] < m:
        issue(Op.BACKWARD_INPUT, 0, m)
        issue(Op.BACKWARD_INPUT, 1, m)
    while count[Op.WEIGHT][0] < m or count[Op.WEIGHT][1] < m:
        issue(Op.WEIGHT, 1, m)
        issue(Op.WEIGHT, 0, m)
    return actions
