"""The trainer's thread count: train.num_threads, then OMP_NUM_THREADS, then free usable cores / local ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from operations import threads
from operations.threads import plan_threads, usable_cores

pytestmark = pytest.mark.tier("fast")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_config_key_wins_over_omp():
    plan = plan_threads(3, {"OMP_NUM_THREADS": "1"}, local_ranks=1, cores=8)
    assert (plan.threads, plan.source) == (3, "train.num_threads=3")


def test_omp_num_threads_is_honoured():
    plan = plan_threads(0, {"OMP_NUM_THREADS": "2,1"}, local_ranks=4, cores=8)
    assert plan.threads == 2 and plan.oversubscription() is None


def test_auto_divides_usable_cores_between_local_ranks():
    assert plan_threads(0, {}, local_ranks=4, cores=16).threads == 4
    assert plan_threads(0, {}, local_ranks=8, cores=2).threads == 1  # never zero
    malformed = plan_threads(0, {"OMP_NUM_THREADS": "many"}, local_ranks=2, cores=8)
    assert malformed.threads == 4 and "ignored" in malformed.source


def test_oversubscription_warns_with_the_fix():
    plan = plan_threads(0, {"OMP_NUM_THREADS": "4"}, local_ranks=2, cores=4)
    warning = plan.oversubscription()
    assert warning is not None and "8 threads on 4 usable cores" in warning and "at most 2" in warning


def test_usable_cores_follows_the_affinity_mask():
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert usable_cores() == expected


def _threads_after_init(omp: str | None, *overrides: str) -> tuple[int, str]:
    """torch.get_num_threads() after init_distributed in a fresh process, and what it logged."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    env["PYTHONPATH"] = REPO_ROOT
    code = (
        "import torch\nfrom operations.startup import init_distributed\n"
        f"init_distributed(False, {overrides[0] if overrides else 0})\nprint('get_num_threads=', torch.get_num_threads())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    count = int(out.stdout.split("get_num_threads=")[1])
    return count, out.stdout


def test_trainer_start_up_uses_one_thread_with_omp_num_threads_1():
    count, log = _threads_after_init("1")
    assert count == 1
    assert "threads: 1 per rank (OMP_NUM_THREADS=1;" in log


def test_trainer_start_up_takes_the_config_key():
    count, log = _threads_after_init("1", "2")
    assert count == 2 and "train.num_threads=2" in log


def test_auto_counts_only_the_free_cores():
    """Next to a busy process the automatic count leaves it its core (issue 33: 3.6x slower otherwise)."""
    plan = plan_threads(0, {}, local_ranks=1, cores=2, free=1)
    assert plan.threads == 1 and plan.source == "auto, 1 of 2 cores free"
    assert plan_threads(0, {}, local_ranks=1, cores=2, free=0).threads == 1  # never zero
    assert plan_threads(0, {}, local_ranks=1, cores=2, free=2) == plan_threads(0, {}, local_ranks=1, cores=2)
    assert plan_threads(0, {}, local_ranks=2, cores=8, free=6).threads == 3


def test_an_explicit_count_ignores_the_free_cores():
    assert plan_threads(2, {}, local_ranks=1, cores=2, free=1).threads == 2
    assert plan_threads(0, {"OMP_NUM_THREADS": "2"}, local_ranks=1, cores=2, free=1).threads == 2


def test_free_cores_counts_the_cores_idle_over_the_sample(monkeypatch):
    """cpu0 busy the whole sample, cpu1 idle 90% of it, cpu2 idle 50%: one free core."""
    snapshots = iter(
        [{0: (100, 1000), 1: (100, 1000), 2: (100, 1000)}, {0: (100, 1100), 1: (190, 1100), 2: (150, 1100)}]
    )
    monkeypatch.setattr(threads, "_cpu_times", lambda cpus: next(snapshots))
    assert threads.free_cores(sample_s=0.0) == 1


def test_free_cores_reads_this_machine():
    free = threads.free_cores(sample_s=0.05)
    assert free is None or 0 <= free <= usable_cores()
