"""One end-to-end run per layout family under real `torchrun`, the way users launch the trainer.

Each run is checked against a one-process run of the same arguments with tools/compare_runs.py (lm_loss and
grad_norm, rtol 1e-5, validation loss too), as a user would check a new layout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import pretrain_gpt
from tests.cli_runner import run_cli
from tests.conftest import REPO_ROOT, free_port, run_ranks, tiny_train_args

pytestmark = pytest.mark.tier("full")  # the launch path: real torchrun runs

# Evaluation on (iterations 0, 5, 10; one batch) so compare_runs also sees val_loss lines; no checkpoint.
COMMON = ("train.eval_iters=1", "checkpoint.save=false")
INTERLEAVED = ("parallel.vp_size=2", "parallel.schedule=interleaved")


def torchrun_command(nproc: int) -> list[str]:
    launcher = shutil.which("torchrun")
    base = [launcher] if launcher else [sys.executable, "-m", "torch.distributed.run"]
    return [
        *base,
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
    ]


def _one_process_main(rank: int, world_size: int, argv: list[str]) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(os.cpu_count() or 1)  # one thread: faster on 2 shared cores
    assert pretrain_gpt.main(argv) == 0


def compare_runs(run_a: str, run_b: str) -> subprocess.CompletedProcess:
    """tools/compare_runs.py's command line (forked by tests/cli_runner: no new interpreter to start)."""
    return run_cli(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "tools", "compare_runs.py"),
            run_a,
            run_b,
            "--key",
            "lm_loss",
            "--key",
            "grad_norm",
        ],
        timeout=120,
    )


@pytest.fixture(scope="module")
def one_process(tiny_corpus, tmp_path_factory):
    """one_process(*model_overrides) -> run dir of the single-process run (a forked process), made once."""
    cache: dict[tuple, str] = {}

    def get(*model_overrides: str) -> str:
        if model_overrides not in cache:
            run_dir = str(tmp_path_factory.mktemp("one_process"))
            argv = [
                "--config",
                pretrain_gpt.DEFAULT_CONFIG,
                *tiny_train_args(tiny_corpus, run_dir, *COMMON, *model_overrides),
            ]
            run_ranks(1, _one_process_main, argv, timeout=240.0)
            cache[model_overrides] = run_dir
        return cache[model_overrides]

    return get


@pytest.mark.parametrize(
    "nproc,model_overrides,parallel_overrides",
    [
        pytest.param(4, (), ("parallel.tp_size=4",), id="tp4"),
        pytest.param(4, ("model.num_layers=8",), ("parallel.pp_size=4", *INTERLEAVED), id="pp4-vp2"),
        pytest.param(
            8,
            (),
            ("parallel.tp_size=2", "parallel.pp_size=2", *INTERLEAVED, "parallel.distributed_optimizer=true"),
            id="tp2-pp2-vp2-distopt",
        ),
    ],
)
def test_torchrun_layout_matches_one_process(
    tiny_corpus, tmp_path, one_process, nproc, model_overrides, parallel_overrides
):
    run_dir = str(tmp_path / "run")
    cmd = [
        *torchrun_command(nproc),
        os.path.join(REPO_ROOT, "pretrain_gpt.py"),
        *tiny_train_args(tiny_corpus, run_dir, *COMMON, *model_overrides, *parallel_overrides),
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = compare_runs(run_dir, one_process(*model_overrides))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "val_loss" in result.stdout
