"""How torch's OpenMP threads wait between parallel regions: asleep (OMP_WAIT_POLICY=PASSIVE) unless the user
chose a wait policy.

libgomp, torch's OpenMP runtime on Linux, reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when `import torch`
loads it; set later they change nothing. By default an idle libgomp thread spins before it sleeps, so on a
shared machine a rank's threads take cores from their neighbours while they wait for each other (two threads
next to one busy process on two cores: 3.6x slower per iteration, docs/performance.md). Sleeping instead
changes no result (the thread count decides the numerics, and operations/threads.py fixes it from the run's
topology), so the entry points (pretrain_gpt.py, tools/evaluate.py, tools/generate.py) add the default before
they import torch. This module imports nothing but the standard library for that reason.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

# The variables that set how libgomp waits; a user who sets either keeps libgomp's reading of it.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
PASSIVE_WAIT = {"OMP_WAIT_POLICY": "PASSIVE"}


def passive_wait_default(environ: Mapping[str, str], loaded_modules: Container[str]) -> dict[str, str]:
    """The variables to add to `environ` so that OpenMP threads sleep while they wait: PASSIVE_WAIT when neither
    of WAIT_VARIABLES is set and torch is not among `loaded_modules` (sys.modules) yet, else nothing (the user's
    choice stands; once torch is loaded libgomp has read its settings, and a variable set then would only make
    the log claim a policy that is not in force)."""
    if "torch" in loaded_modules or any(name in environ for name in WAIT_VARIABLES):
        return {}
    return dict(PASSIVE_WAIT)


def describe_wait(environ: Mapping[str, str]) -> str:
    """How this process's OpenMP threads wait, for the start-up line: the wait variables set, or libgomp's
    default (spin, then sleep)."""
    chosen = [f"{name}={environ[name]}" for name in WAIT_VARIABLES if name in environ]
    return ", ".join(chosen) if chosen else "OpenMP's default wait (spins, then sleeps)"
