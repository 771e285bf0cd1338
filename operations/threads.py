"""How many intra-op threads a rank uses: train.num_threads, else OMP_NUM_THREADS, else its share of the
cores that are free.

`torch.set_num_threads` overrides OMP_NUM_THREADS, so a trainer that always sets it from the core count
silently ignores the launcher's choice (torchrun exports OMP_NUM_THREADS=1). On a shared machine OpenMP
threads that outnumber the free cores spin against other jobs: a tiny step took 26-47 s with two threads on
two busy cores against 0.3 s with one, and the default run went from 305 to 1,100 ms/iter (3.6x) with one
competing busy process on two cores, against 350-450 with one thread. So an explicit choice always wins, and
the automatic one divides the cores this process may run on (its affinity mask, not the machine's count)
between the ranks of the node, counting only the cores that are free when the run starts (their idle share
over FREE_CORE_SAMPLE_S, from /proc/stat): on an idle machine that is every core, as before; next to a busy
process it leaves that process its core (scripts/benchmarks/bench_threads_shared.py, docs/performance.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from operations.log import get_logger

FREE_CORE_SAMPLE_S = 0.1  # how long the automatic count watches the cores before it counts the free ones
# A core counts as free when it was idle at least this share of the sample: a neighbour's short bursts
# (a shell, a logger) do not take a thread away; a busy process (idle share ~0) does.
FREE_SHARE = 0.7


@dataclass(frozen=True)
class ThreadPlan:
    """The thread count chosen for one rank and why."""

    threads: int
    source: str  # what decided it: "train.num_threads=4", "OMP_NUM_THREADS=1", "auto" or "auto, 1 core free"
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


def _cpu_times(cpus: Sequence[int]) -> dict[int, tuple[int, int]]:
    """(idle, total) jiffies of each of `cpus` from /proc/stat (Linux)."""
    times = {}
    with open("/proc/stat", encoding="ascii") as handle:
        for line in handle:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                values = [int(value) for value in fields[:8]]  # user nice system idle iowait irq softirq steal
                times[int(name[3:])] = (values[3] + values[4], sum(values))
    return times


def free_cores(sample_s: float = FREE_CORE_SAMPLE_S) -> int | None:
    """How many of this process's usable cores were idle (at least FREE_SHARE of `sample_s`) just now; None
    where that cannot be read (not Linux)."""
    if not hasattr(os, "sched_getaffinity") or not os.path.exists("/proc/stat"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    try:
        before = _cpu_times(cpus)
        time.sleep(sample_s)
        after = _cpu_times(cpus)
    except (OSError, ValueError):
        return None
    free = 0
    for cpu, (idle, total) in after.items():
        idle_before, total_before = before.get(cpu, (idle, total))
        elapsed = total - total_before
        if elapsed <= 0 or (idle - idle_before) / elapsed >= FREE_SHARE:
            free += 1  # no tick counted: nothing ran there either
    return free


def plan_threads(
    requested: int, environ: Mapping[str, str], local_ranks: int, cores: int, free: int | None = None
) -> ThreadPlan:
    """The thread count for one rank: `requested` (train.num_threads) when > 0, else a positive integer
    OMP_NUM_THREADS, else (the `free` cores, when given, else all) // local_ranks, at least one."""
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
    available = cores
    if free is not None and free < cores:
        available = free
        source += f", {free} of {cores} cores free"
    return ThreadPlan(max(1, available // local_ranks), source, cores, local_ranks)


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
    """Choose (see `plan_threads`) and apply this rank's intra-op thread count; returns the plan to log. The
    free cores are measured only where the automatic count would give a rank more than one thread."""
    environ = os.environ if environ is None else environ
    cores = usable_cores()
    plan = plan_threads(requested, environ, local_ranks, cores)
    if plan.source == "auto" and plan.threads > 1:
        plan = plan_threads(requested, environ, local_ranks, cores, free_cores())
    torch.set_num_threads(plan.threads)
    return plan


def log_thread_plan(plan: ThreadPlan, rank: int, local_rank: int) -> None:
    """Log the count once (the logging rank) and the oversubscription warning once per node."""
    logger = get_logger(rank)
    logger.info(plan.describe())
    warning = plan.oversubscription()
    if warning is not None and local_rank == 0:
        logger.warning(warning)
