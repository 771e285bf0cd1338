"""How many intra-op threads a rank uses: train.num_threads, else OMP_NUM_THREADS, else its share of the cores.

`torch.set_num_threads` overrides OMP_NUM_THREADS, so a trainer that always sets it from the core count
silently ignores the launcher's choice (torchrun exports OMP_NUM_THREADS=1). On a shared machine OpenMP
threads that outnumber the free cores spin against other jobs: a tiny step took 26-47 s with two threads on
two busy cores against 0.3 s with one. So an explicit choice always wins, and the automatic one divides the
cores this process may run on (its affinity mask, not the machine's count) between the ranks of the node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from training.logging import get_logger


@dataclass(frozen=True)
class ThreadPlan:
    """The thread count chosen for one rank and why."""

    threads: int
    source: str  # what decided it: "train.num_threads=4", "OMP_NUM_THREADS=1" or "auto"
    usable_cores: int  # cores in this process's affinity mask
    local_ranks: int  # ranks sharing this node's cores

    def describe(self) -> str:
        """One log line: the count, what chose it, and the cores it shares."""
        return (
            f"threads: {self.threads} per rank ({self.source}; {self.usable_cores} usable cores, "
            f"{self.local_ranks} local rank(s))"
        )

    def oversubscription(self) -> str | None:
        """A warning when the node's ranks together run more threads than the cores they may use."""
        total = self.threads * self.local_ranks
        if total <= self.usable_cores:
            return None
        return (
            f"warning: {self.local_ranks} local rank(s) x {self.threads} threads = {total} threads on "
            f"{self.usable_cores} usable cores ({self.source}): threads will wait on each other; set "
            f"train.num_threads or OMP_NUM_THREADS to at most {max(1, self.usable_cores // self.local_ranks)}"
        )


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), falling back to the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def plan_threads(requested: int, environ: Mapping[str, str], local_ranks: int, cores: int) -> ThreadPlan:
    """The thread count for one rank: `requested` (train.num_threads) when > 0, else a positive integer
    OMP_NUM_THREADS, else cores // local_ranks (at least one)."""
    local_ranks = max(local_ranks, 1)
    if requested > 0:
        return ThreadPlan(requested, f"train.num_threads={requested}", cores, local_ranks)
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    # OpenMP accepts a list ("4,2") of per-nesting-level counts; the first is the intra-op one.
    first = omp.split(",")[0].strip()
    if first.isdigit() and int(first) >= 1:
        return ThreadPlan(int(first), f"OMP_NUM_THREADS={omp}", cores, local_ranks)
    # OpenMP ignores a malformed value too; say so in the log line rather than fail after start-up.
    source = f"auto, OMP_NUM_THREADS={omp!r} ignored" if omp else "auto"
    return ThreadPlan(max(1, cores // local_ranks), source, cores, local_ranks)


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
    plan = plan_threads(requested, os.environ if environ is None else environ, local_ranks, usable_cores())
    torch.set_num_threads(plan.threads)
    return plan


def log_thread_plan(plan: ThreadPlan, rank: int, local_rank: int) -> None:
    """Log the count once (the logging rank) and the oversubscription warning once per node."""
    logger = get_logger(rank)
    logger.info(plan.describe())
    warning = plan.oversubscription()
    if warning is not None and local_rank == 0:
        logger.warning(warning)
