"""The trainer's thread count: train.num_threads, then OMP_NUM_THREADS, then usable cores / local ranks (never the
load); and how its OpenMP threads wait."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
import time

import pytest
import torch

from operations.openmp_wait import describe_wait, passive_wait_default
from operations.threads import plan_threads, set_threads, usable_cores

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


def test_more_ranks_than_cores_warns_with_the_fix_that_helps():
    """32 ranks on 2 cores run 1 thread each already: the warning names the ranks per node, not the threads."""
    warning = plan_threads(0, {"OMP_NUM_THREADS": "1"}, local_ranks=32, cores=2).oversubscription()
    assert warning is not None and "32 threads on 2 usable cores" in warning
    assert "at most 2 rank(s) per node" in warning and "OMP_NUM_THREADS to at most" not in warning


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


def test_auto_is_fixed_by_the_topology():
    """Issue 40: the automatic count is usable cores // local ranks whatever else runs; a count that followed the
    free cores made a run resumed on a quiet machine differ from its start next to a busy process."""
    plan = plan_threads(0, {}, local_ranks=1, cores=2)
    assert (plan.threads, plan.source) == (2, "auto")
    assert plan_threads(0, {}, local_ranks=2, cores=8).threads == 4


def test_the_choice_reads_no_load(monkeypatch):
    """set_threads decides without /proc/stat, /proc/loadavg, os.getloadavg or a sample over time."""
    real_open = builtins.open

    def no_load_open(file, *args, **kwargs):
        if str(file).startswith(("/proc/stat", "/proc/loadavg")):
            raise AssertionError(f"the thread choice read {file}")
        return real_open(file, *args, **kwargs)

    def no_sampling(*args):
        raise AssertionError("the thread choice sampled the machine over time or read its load")

    monkeypatch.setattr(builtins, "open", no_load_open)
    monkeypatch.setattr(os, "getloadavg", no_sampling)
    monkeypatch.setattr(time, "sleep", no_sampling)
    before = torch.get_num_threads()
    try:
        plan = set_threads(0, 1, {})
        assert plan.threads == torch.get_num_threads() == usable_cores() and plan.source == "auto"
    finally:
        torch.set_num_threads(before)


def test_the_plan_names_its_wait_and_writes_a_record():
    plan = plan_threads(0, {"OMP_WAIT_POLICY": "PASSIVE"}, local_ranks=2, cores=4)
    assert plan.describe() == "threads: 2 per rank (auto; 4 usable cores, 2 local rank(s); OMP_WAIT_POLICY=PASSIVE)"
    assert plan.record() == {
        "threads": 2,
        "threads_source": "auto",
        "usable_cores": 4,
        "local_ranks": 2,
        "omp_wait": "OMP_WAIT_POLICY=PASSIVE",
    }
    assert plan_threads(1, {}, local_ranks=1, cores=2).wait == "OpenMP's default wait (spins, then sleeps)"


def test_passive_wait_is_added_only_before_torch_and_only_when_unset():
    assert passive_wait_default({}, set()) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert passive_wait_default({"OMP_WAIT_POLICY": "ACTIVE"}, set()) == {}  # the user's choice stands
    assert passive_wait_default({"GOMP_SPINCOUNT": "10000"}, set()) == {}
    assert passive_wait_default({}, {"torch"}) == {}  # libgomp has read its settings already
    assert describe_wait({"GOMP_SPINCOUNT": "10000", "OMP_WAIT_POLICY": "ACTIVE"}) == (
        "OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT=10000"
    )


# Run in a fresh interpreter: records OMP_WAIT_POLICY at the moment `import torch` starts (libgomp's only read).
_WAIT_AT_TORCH_IMPORT = """
import os, sys
seen = []
def hook(event, args):
    if event == "import" and args[0] == "torch" and not seen:
        seen.append(os.environ.get("OMP_WAIT_POLICY"))
sys.addaudithook(hook)
import importlib
importlib.import_module(sys.argv[1])
print("wait at torch import:", seen)
"""


@pytest.mark.parametrize("entry_point", ["pretrain_gpt", "tools.evaluate", "tools.generate"])
def test_entry_points_set_passive_wait_before_torch_loads(entry_point):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = REPO_ROOT
    out = subprocess.run(
        [sys.executable, "-c", _WAIT_AT_TORCH_IMPORT, entry_point],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "wait at torch import: ['PASSIVE']" in out.stdout
