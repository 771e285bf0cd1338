"""scripts/gpu_check.sh end to end with --cpu-dry-run --quick: every stage of the quick list runs at toy sizes
on the CPU (checkpoint saved at 1 rank and resumed at tp2, environment, kernel tests in the interpreter, kernel
benchmark, 124M-stage throughput), each leaves its results file, and the summary says ok for each."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.tier("full")  # the GPU check's dry run: many python starts

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK_STAGES = ["1 checkpoint", "2 env", "3 kernels", "4 speed", "5 gpt124m"]


def test_gpu_check_cpu_dry_run_quick(tmp_path):
    out = tmp_path / "results"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--cpu-dry-run", "--quick", "--out", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    for stage in QUICK_STAGES:
        line = next(line for line in summary.splitlines() if line.startswith(stage))
        assert ": ok in " in line, summary
        number, name = stage.split()
        assert (out / f"{number}_{name}.txt").stat().st_size > 0
    assert "6 gpt1p3b" not in summary  # --quick leaves the 1.3B stage out
    assert "GPT-2 124M" in (out / "5_gpt124m.txt").read_text()
