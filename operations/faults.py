"""A test hook that makes one rank misbehave, to check that hangs and stragglers are caught and named.

    PTDP_INJECT_FAULT="rank=R,iteration=N,kind=K"

read from the environment only (no config key: it can never be left on in a run's saved config), checked at
start (one line, exit 2, for a malformed value or a rank outside the world) and named in the log when set:

    sleep   rank R stalls before its first collective of iteration N (the iteration boundary's all-reduce) and
            never returns: its peers wait in that collective until it times out, its own watchdog stops it
    skip    rank R leaves out that collective and goes on: the ranks' sequences of collectives part there
    slow    from iteration N on, rank R sleeps before each collective or pipeline transfer of the step as long as
            it computed since the previous one returned: each of its steps takes twice as long
    raise   rank R raises `InjectedFault` as iteration N's step starts (after its batch was read), an error
            nothing in the trainer handles, as a bug in a step would be: the crash path, data workers and all

sleep, skip and slow act through `Collectives.before_issue` (parallel/comm.py), on the training loop's collectives
only (regions "boundary" and "train"); the rank's records show what it did, as a real fault would leave them. A
one-process run has no collectives, so they are refused there (they would never fire); raise is called by the
training loop itself and fires in any run. An iteration after train.train_iters is refused for the same reason.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from parallel.comm_recorder import P2P_KINDS, CommRecorder

ENV_VAR = "PTDP_INJECT_FAULT"
COLLECTIVE_KINDS = ("sleep", "skip", "slow")  # act through Collectives.before_issue
KINDS = (*COLLECTIVE_KINDS, "raise")
TRAINING_REGIONS = ("boundary", "train")
_FORM = "expected rank=R,iteration=N,kind=sleep|skip|slow|raise"
# Longer digit strings are past any bound (world size, train_iters) without converting them: int() refuses
# strings over 4300 digits with a message of its own.
_MAX_DIGITS = 12


class InjectedFault(RuntimeError):
    """What kind=raise raises in the training loop (nothing in the trainer catches it)."""


@dataclass(frozen=True)
class FaultSpec:
    rank: int
    iteration: int
    kind: str

    def describe(self) -> str:
        what = {
            "sleep": f"stalls before its first collective of iteration {self.iteration}",
            "skip": f"leaves out its first collective of iteration {self.iteration}",
            "slow": f"takes twice as long for each step from iteration {self.iteration} on",
            "raise": f"raises an error as the step of iteration {self.iteration} starts",
        }[self.kind]
        return f"{ENV_VAR}={self.text}: test hook active: rank {self.rank} {what}"

    @property
    def text(self) -> str:
        return f"rank={self.rank},iteration={self.iteration},kind={self.kind}"

    def raise_if_due(self, rank: int, iteration: int) -> None:
        """kind=raise: InjectedFault on rank `self.rank` at iteration `self.iteration` (the loop calls this as
        each step starts); nothing for any other kind, rank or iteration."""
        if self.kind == "raise" and rank == self.rank and iteration == self.iteration:
            raise InjectedFault(f"{ENV_VAR}={self.text}: rank {rank} raises at iteration {iteration}")


def parse_fault(value: str, world_size: int, train_iters: int) -> FaultSpec:
    """The fault `value` describes for a run of `world_size` ranks and `train_iters` iterations; ValueError with
    one line naming what is wrong, and why when the value is well formed but would never fire."""
    fields: dict[str, str] = {}
    for part in value.split(","):
        key, sep, item = part.strip().partition("=")
        if not sep or key not in ("rank", "iteration", "kind") or key in fields:
            raise ValueError(f"{ENV_VAR}={value!r}: {part.strip()!r} is not a field or is repeated; {_FORM}")
        fields[key] = item.strip()
    missing = [key for key in ("rank", "iteration", "kind") if key not in fields]
    if missing:
        raise ValueError(f"{ENV_VAR}={value!r}: {missing[0]} is missing; {_FORM}")
    kind = fields["kind"]
    if kind not in KINDS:
        raise ValueError(f"{ENV_VAR}={value!r}: kind={kind} is not one of {', '.join(KINDS)}")
    for key in ("rank", "iteration"):
        if not (fields[key].isascii() and fields[key].isdigit()):  # str.isdigit alone takes '²', which int() refuses
            raise ValueError(f"{ENV_VAR}={value!r}: {key}={fields[key]} is not a non-negative integer; {_FORM}")
    rank_text, iteration_text = fields["rank"], fields["iteration"]
    if len(rank_text.lstrip("0")) > _MAX_DIGITS or int(rank_text) >= world_size:
        raise ValueError(f"{ENV_VAR}={value!r}: rank={rank_text} is outside this run's {world_size} rank(s)")
    if len(iteration_text.lstrip("0")) > _MAX_DIGITS or int(iteration_text) > train_iters:
        raise ValueError(
            f"{ENV_VAR}={value!r}: iteration={iteration_text} is after this run's last iteration "
            f"(train.train_iters={train_iters}): the fault would never fire"
        )
    spec = FaultSpec(int(rank_text), int(iteration_text), kind)
    if spec.iteration < 1:
        raise ValueError(f"{ENV_VAR}={value!r}: iteration={spec.iteration} must be >= 1 (iterations count from 1)")
    if world_size == 1 and kind in COLLECTIVE_KINDS:
        raise ValueError(
            f"{ENV_VAR}={value!r}: kind={kind} acts on the rank's collectives and a one-process run has none, so "
            f"it would never fire: run 2 or more ranks (kind=raise fires in one process too)"
        )
    return spec


def fault_from_env(world_size: int, train_iters: int, environ: Mapping[str, str] | None = None) -> FaultSpec | None:
    """The fault the environment asks for, or None (unset or empty)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    return parse_fault(value, world_size, train_iters) if value else None


class FaultInjector:
    """`Collectives.before_issue` for rank `spec.rank` (a kind of COLLECTIVE_KINDS): returns False for the one
    call `skip` leaves out."""

    def __init__(self, spec: FaultSpec, recorder: CommRecorder, logger: logging.Logger):
        if spec.kind not in COLLECTIVE_KINDS:
            raise ValueError(f"{ENV_VAR}: kind={spec.kind} does not act on collectives (the training loop raises it)")
        self.spec, self.recorder, self.logger = spec, recorder, logger
        self.done = False

    def __call__(self, kind: str, group: str, async_op: bool) -> bool:
        recorder, spec = self.recorder, self.spec
        if recorder.region not in TRAINING_REGIONS or recorder.iteration < spec.iteration:
            return True
        if spec.kind == "slow":
            time.sleep(max(0.0, time.perf_counter() - recorder.last_return))
            return True
        if self.done or recorder.iteration != spec.iteration or kind in P2P_KINDS or kind == "p2p" or async_op:
            return True
        self.done = True
        if spec.kind == "skip":
            self.logger.warning(
                f"{ENV_VAR}: rank {spec.rank} leaves out {kind} on {group} at iteration {spec.iteration}"
            )
            return False
        self.logger.warning(
            f"{ENV_VAR}: rank {spec.rank} stalls before {kind} on {group} at iteration {spec.iteration} "
            f"(until it is stopped)"
        )
        while True:  # a rank stuck outside any collective: only its watchdog (or a kill) ends this
            time.sleep(3600)
