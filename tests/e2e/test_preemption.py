"""Stop signals on one process: SIGTERM / SIGUSR1 / SIGINT save a checkpoint of the current iteration, exit 3,
and the resumed run's losses equal an uninterrupted run's, bit for bit."""

import os
import signal
import subprocess
import sys
import time

import pytest

import checkpoint
import pretrain_gpt
from operations.guards import EXIT_INTERRUPTED, EXIT_PREEMPTED
from tests.conftest import REPO_ROOT, read_metrics, tiny_train_args
from training import loop

pytestmark = pytest.mark.tier("full")  # the launch path: signals to the trainer

# A schedule that does not depend on train_iters, so a run of any length has the same LR at each iteration.
STEADY = ("train.train_iters=12", "optim.lr_decay_iters=100", "train.eval_interval=100", "train.eval_iters=1")


def run_main(corpus, run_dir, *extra):
    return pretrain_gpt.main(
        ["--config", pretrain_gpt.DEFAULT_CONFIG, *tiny_train_args(corpus, run_dir, *STEADY, *extra)]
    )


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    assert run_main(tiny_corpus, run_dir) == 0
    return [r["lm_loss"] for r in read_metrics(run_dir)]


def signal_at(monkeypatch, iteration: int, *signals: signal.Signals) -> None:
    """Deliver `signals` to this process right after `iteration` finishes (a real kill(2), real handler)."""
    real_after_step = loop.after_step

    def after_step(run, *args):
        real_after_step(run, *args)
        if run.progress.iteration == iteration:
            for sig in signals:
                os.kill(os.getpid(), sig)

    monkeypatch.setattr(loop, "after_step", after_step)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=lambda s: s.name)
def test_signal_saves_exits_3_and_resumes_bitwise(tiny_corpus, tmp_path, monkeypatch, reference, sig):
    run_dir = str(tmp_path / "run")
    found = signal.getsignal(sig)  # SIG_IGN for SIGINT when the suite was started in the background
    signal_at(monkeypatch, 5, sig)
    assert run_main(tiny_corpus, run_dir) == EXIT_PREEMPTED
    assert checkpoint.read_tracker(os.path.join(run_dir, "checkpoints")) == 5
    assert [r["iteration"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5]
    monkeypatch.undo()
    assert signal.getsignal(sig) == found  # the handler this test found is restored
    assert run_main(tiny_corpus, run_dir, "checkpoint.load=true") == 0
    assert [r["lm_loss"] for r in read_metrics(run_dir)] == reference  # bitwise, iterations 1-12


def test_second_sigint_stops_at_once_without_a_checkpoint(tiny_corpus, tmp_path, monkeypatch, capsys):
    run_dir = str(tmp_path / "run")
    signal_at(monkeypatch, 3, signal.SIGINT, signal.SIGINT)
    assert run_main(tiny_corpus, run_dir) == EXIT_INTERRUPTED
    assert "stopped at once" in capsys.readouterr().err
    assert checkpoint.read_tracker(os.path.join(run_dir, "checkpoints")) is None
    assert not os.path.exists(os.path.join(run_dir, "run.lock"))


def test_sigterm_to_every_process_of_the_run(tiny_corpus, tmp_path):
    """A real SIGTERM mid-run to `python pretrain_gpt.py` and its DataLoader worker, as `scancel` (every
    process of the step) or Ctrl-C (the foreground group) deliver it: exit 3, checkpoint of the last
    iteration, and the worker keeps serving batches until then."""
    run_dir = str(tmp_path / "run")
    args = tiny_train_args(
        tiny_corpus,
        run_dir,
        "train.train_iters=100000",
        "optim.lr_decay_iters=100",
        "train.eval_interval=100000",
        "train.eval_iters=1",
        "data.num_workers=1",
    )
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("iter ") and "/100000" in line:
                break
        os.killpg(proc.pid, signal.SIGTERM)  # the group of this test's own child: the trainer and its worker
        output = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    saved = checkpoint.read_tracker(os.path.join(run_dir, "checkpoints"))
    assert saved >= 1 and f"stopped by SIGTERM after iteration {saved}" in output
    assert output.count("received SIGTERM") == 1 and "Traceback" not in output
    assert read_metrics(run_dir)[-1]["iteration"] == saved


def test_exit_duration_counts_from_job_start(tiny_corpus, tmp_path, monkeypatch):
    """SLURM_JOB_START_TIME an hour ago and exit_duration_mins=30: stops (and saves) before iteration 1."""
    run_dir = str(tmp_path / "run")
    monkeypatch.setenv("SLURM_JOB_START_TIME", str(int(time.time()) - 3600))
    assert run_main(tiny_corpus, run_dir, "train.exit_duration_mins=30") == 0
    assert checkpoint.read_tracker(os.path.join(run_dir, "checkpoints")) == 0
