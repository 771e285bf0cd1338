"""A test hook that makes one rank misbehave, to check that hangs and stragglers are caught and named.

    PTDP_INJECT_FAULT="rank=R,iteration=N,kind=K"

read from the environment only (no config key: it can never be left on in a run's saved config), checked at
start (one line, exit 2, for a malformed value or a rank outside the world) and named in the log when set:

    sleep   rank R stalls before its first collective of iteration N (the iteration boundary's all-reduce) and
            never returns: its peers wait in that collective until it times out, its own watchdog stops it
    skip    rank R leaves out that collective and goes on: the ranks' sequences of collectives part there
    slow    from iteration N on, rank R sleeps before each collective or pipeline transfer of the step as long as
            it computed since the previous one returned: each of its steps takes twice as long

It acts through `Collectives.before_issue` (parallel/comm.py), on the training loop's collectives only
(regions "boundary" and "train"); the rank's records show what it did, as a real fault would leave them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from parallel.comm import P2P_KINDS, CommRecorder

ENV_VAR = "PTDP_INJECT_FAULT"
KINDS = ("sleep", "skip", "slow")
TRAINING_REGIONS = ("boundary", "train")
_FORM = "expected rank=R,iteration=N,kind=sleep|skip|slow"


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
        }[self.kind]
        return f"{ENV_VAR}={self.text}: test hook active: rank {self.rank} {what}"

    @property
    def text(self) -> str:
        return f"rank={self.rank},iteration={self.iteration},kind={self.kind}"


def parse_fault(value: str, world_size: int) -> FaultSpec:
    """The fault `value` describes; ValueError with one line naming what is wrong."""
    fields: dict[str, str] = {}
    for part in value.split(","):
        key, sep, item = part.strip().partition("=")
        if not sep or key not in ("rank", "iteration", "kind") or key in fields:
            raise ValueError(f"{ENV_VAR}={value!r}: {part.strip()!r} is not a field or is repeated; {_FORM}")
        fields[key] = item.strip()
    missing = [key for key in ("rank", "iteration", "kind") if key not in fields]
    if missing:
        raise ValueError(f"{ENV_VAR}={value!r}: {missing[0]} is missing; {_FORM}")
    if fields["kind"] not in KINDS:
        raise ValueError(f"{ENV_VAR}={value!r}: kind={fields['kind']} is not one of {', '.join(KINDS)}")
    for key in ("rank", "iteration"):
        if not fields[key].isdigit() or len(fields[key]) > 12:
            raise ValueError(f"{ENV_VAR}={value!r}: {key}={fields[key]} is not a non-negative integer; {_FORM}")
    spec = FaultSpec(int(fields["rank"]), int(fields["iteration"]), fields["kind"])
    if spec.rank >= world_size:
        raise ValueError(f"{ENV_VAR}={value!r}: rank={spec.rank} is outside this run's {world_size} rank(s)")
    if spec.iteration < 1:
        raise ValueError(f"{ENV_VAR}={value!r}: iteration={spec.iteration} must be >= 1 (iterations count from 1)")
    return spec


def fault_from_env(world_size: int, environ: Mapping[str, str] | None = None) -> FaultSpec | None:
    """The fault the environment asks for, or None (unset or empty)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    return parse_fault(value, world_size) if value else None


class FaultInjector:
    """`Collectives.before_issue` for rank `spec.rank`: returns False for the one call `skip` leaves out."""

    def __init__(self, spec: FaultSpec, recorder: CommRecorder, logger: logging.Logger):
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
