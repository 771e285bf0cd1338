"""How many intra-op threads a rank uses: train.num_threads, else OMP_NUM_THREADS, else the cores its process may
run on divided between the node's ranks. Never the machine's load.

`torch.set_num_threads` overrides OMP_NUM_THREADS, so a trainer that always sets it from the core count
silently ignores the launcher's choice (torchrun exports OMP_NUM_THREADS=1): an explicit choice always wins.
The automatic count divides the cores in this process's affinity mask (not the machine's count) between the
ranks of the node. It is a function of the run's topology only because the thread count changes a run's last
bits (matmul blocking, reduction order): an earlier rule counted the cores free at start, and a run started
next to a busy process (1 thread) and resumed on a quiet machine (2) differed at 1.2e-7 where resume is bitwise
(issue 40). Sharing a busy machine gracefully is left to how the threads wait, which changes no result: the
entry points make them sleep instead of spin (operations/openmp_wait.py; next to one busy process on two cores
spinning threads ran 4.65x slower than idle, docs/performance.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from operations.log import get_logger
from operations.openmp_wait import describe_wait


@dataclass(frozen=True)
class ThreadPlan:
    """The thread count chosen for one rank, why, and how its threads wait."""

    threads: int
    source: str  # what decided it: "train.num_threads=4", "OMP_NUM_THREADS=1" or "auto"
    usable_cores: int  # cores in this process's affinity mask
    local_ranks: int  # ranks sharing this node's cores
    wait: str = ""  # how idle OpenMP threads wait (operations/openmp_wait.py), e.g. "OMP_WAIT_POLICY=PASSIVE"

    def describe(self) -> str:
        """One log line: the count, what chose it, the cores it shares and how its threads wait."""
        return (
            f"threads: {self.threads} per rank ({self.source}; {self.usable_cores} usable cores, "
            f"{self.local_ranks} local rank(s); {self.wait})"
        )

    def record(self) -> dict[str, int | str]:
        """The choice as metrics.jsonl fields (written once at the start of each run and resume)."""
        return {
            "threads": self.threads,
            "threads_source": self.source,
            "usable_cores": self.usable_cores,
            "local_ranks": self.local_ranks,
            "omp_wait": self.wait,
        }

    def oversubscription(self) -> str | None:
        """A warning when the node's ranks together run more threads than the cores they may use."""
        total = self.threads * self.local_ranks
        if total <= self.usable_cores:
            return None
        fixes = []
        if self.threads > 1:
            most = max(1, self.usable_cores // self.local_ranks)
            fixes.append(f"set train.num_threads or OMP_NUM_THREADS to at most {most}")
        if self.local_ranks > self.usable_cores:  # one thread is the least: only fewer ranks (or more cores) help
            fixes.append(f"run at most {self.usable_cores} rank(s) per node, or give them more cores")
        fix = "; ".join(fixes)
        return (
            f"warning: {self.local_ranks} local rank(s) x {self.threads} threads = {total} threads on "
            f"{self.usable_cores} usable cores ({self.source}): threads will wait on each other; {fix}"
        )


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), falling back to the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def plan_threads(requested: int, environ: Mapping[str, str], local_ranks: int, cores: int) -> ThreadPlan:
    """The thread count for one rank: `requested` (train.num_threads) when > 0, else a positive integer
    OMP_NUM_THREADS, else `cores` // local_ranks, at least one. It reads nothing that changes while a run's
    topology stays the same (no load, no clock), so a resumed run computes what the uninterrupted one did."""
    local_ranks = max(local_ranks, 1)
    wait = describe_wait(environ)
    if requested > 0:
        return ThreadPlan(requested, f"train.num_threads={requested}", cores, local_ranks, wait)
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    # OpenMP accepts a list ("4,2") of per-nesting-level counts; the first is the intra-op one.
    first = omp.split(",")[0].strip()
    if first.isdigit() and int(first) >= 1:
        return ThreadPlan(int(first), f"OMP_NUM_THREADS={omp}", cores, local_ranks, wait)
    # OpenMP ignores a malformed value too; say so in the log line rather than fail after start-up.
    source = f"auto, OMP_NUM_THREADS={omp!r} ignored" if omp else "auto"
    return ThreadPlan(max(1, cores // local_ranks), source, cores, local_ranks, wait)


def check_cpu_requests(num_threads: int, data_workers: int, environ: Mapping[str, str], cores: int) -> None:
    """Refuse (ValueError, one line) a thread count (train.num_threads, else OMP_NUM_THREADS) or a number of
    data loader processes (data.num_workers) above the `cores` this process may use: more never helps, and
    huge ones kill the run (torch.set_num_threads(100000) ends in SIGSEGV; 100000 workers exhaust memory)."""
    plan = plan_threads(num_threads, environ, 1, cores)
    if plan.threads > cores and not plan.source.startswith("auto"):
        fix = (
            f"give at most {cores} (0: share the cores among the node's ranks)"
            if num_threads > 0
            else f"export at most {cores}, or set train.num_threads"
        )
        raise ValueError(f"{plan.source} is more threads than the {cores} cores this process may use: {fix}")
    if data_workers > cores:
        raise ValueError(
            f"data.num_workers={data_workers} is more loader processes than the {cores} cores this process may "
            f"use: give at most {cores} (0: load in the training process)"
        )


def set_threads(requested: int, local_ranks: int, environ: Mapping[str, str] | None = None) -> ThreadPlan:
    """Choose (see `plan_threads`) and apply this rank's intra-op thread count; returns the plan to log."""
    environ = os.environ if environ is None else environ
    plan = plan_threads(requested, environ, local_ranks, usable_cores())
    torch.set_num_threads(plan.threads)
    return plan


def log_thread_plan(plan: ThreadPlan, rank: int, local_rank: int) -> None:
    """Log the count once (the logging rank) and the oversubscription warning once per node."""
    logger = get_logger(rank)
    logger.info(plan.describe())
    warning = plan.oversubscription()
    if warning is not None and local_rank == 0:
        logger.warning(warning)
