"""Issue 40: exact resume does not depend on the machine's load. The default thread count (no OMP_NUM_THREADS,
no train.num_threads) is fixed by the run's topology, so a run stopped while a busy process shares its cores and
resumed on a quiet machine equals the uninterrupted run bitwise, and metrics.jsonl says which count each part used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import pretrain_gpt
from operations.threads import usable_cores
from tests.conftest import read_metrics, tiny_train_args

pytestmark = pytest.mark.tier("full")  # the trainer next to a busy process, stopped and resumed: seconds of waiting

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A competing process pinned to one of the trainer's cores: what made the old rule pick fewer threads.
BUSY_LOOP = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nprint('busy', flush=True)\nwhile True: pass"


def _trainer_env() -> dict[str, str]:
    """The user's default: no thread count and no wait policy chosen (the trainer picks both)."""
    drop = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    env = {key: value for key, value in os.environ.items() if key not in drop}
    env["PYTHONPATH"] = REPO_ROOT
    return env


def _train(corpus: dict, run_dir: str, *extra: str) -> str:
    """Run the trainer in a fresh process (its own OpenMP start-up) for 6 iterations; returns its stdout."""
    argv = [sys.executable, "pretrain_gpt.py", "--config", pretrain_gpt.DEFAULT_CONFIG]
    argv += tiny_train_args(corpus, run_dir, "train.train_iters=6", *extra)
    out = subprocess.run(argv, cwd=REPO_ROOT, env=_trainer_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def _start_records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        return [record for record in map(json.loads, handle) if "threads" in record]


def test_resume_after_a_busy_start_is_bitwise(tiny_corpus, tmp_path):
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    _train(tiny_corpus, whole)
    busy = subprocess.Popen(
        [sys.executable, "-c", BUSY_LOOP, str(min(os.sched_getaffinity(0)))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert busy.stdout is not None and busy.stdout.readline() == "busy\n"
        time.sleep(0.3)  # spinning on its core when the trainer starts
        busy_log = _train(tiny_corpus, split, "train.exit_interval=3")
    finally:
        busy.kill()
        busy.wait()
    _train(tiny_corpus, split, "checkpoint.load=true")

    expected = [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in read_metrics(whole)]
    resumed = [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in read_metrics(split)]
    assert len(expected) == 6 and resumed == expected  # bitwise, iterations 4-6 from the resume
    (start,) = _start_records(whole)
    busy_start, quiet_resume = _start_records(split)
    assert (busy_start["iteration"], quiet_resume["iteration"]) == (0, 3)
    assert f"threads: {usable_cores()} per rank (auto; {usable_cores()} usable cores" in busy_log, busy_log[-2000:]
    for record in (start, busy_start, quiet_resume):
        assert record["threads"] == usable_cores() and record["threads_source"] == "auto", record
        assert record["omp_wait"] == "OMP_WAIT_POLICY=PASSIVE", record
