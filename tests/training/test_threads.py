"""The trainer's thread count: train.num_threads, then OMP_NUM_THREADS, then usable cores / local ranks."""

from __future__ import annotations

import os
import subprocess
import sys

from training.threads import plan_threads, usable_cores

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
        "import torch\nfrom training.setup import init_distributed\n"
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
