"""Stop signals under real torchrun with 4 ranks (tp 2 x pp 2): SIGTERM / SIGINT to torchrun (it forwards them
to its ranks), SIGUSR1 to the ranks (what SLURM's `scancel --signal=USR1` does), and SIGUSR1 / SIGKILL to
torchrun, which dies of them: its ranks notice that their launcher is gone (the kernel's parent-death signal)
and stop as if it had sent SIGTERM. Every rank stops after the same iteration, a checkpoint of it is saved, the
ranks exit 3, and a resumed run's losses equal an uninterrupted run's bit for bit. The signalled runs are real
torchrun runs; the uninterrupted reference and the resumes, which check the checkpoint and not the launcher,
run the same trainer on 4 gloo ranks of tests/conftest.run_ranks (each torchrun start costs ~25 CPU s of
python and torch imports: docs/testing.md)."""

import os
import signal
import subprocess
import time

import pytest

import checkpoint
import pretrain_gpt
from tests.conftest import REPO_ROOT, read_metrics, run_ranks, tiny_train_args
from tests.e2e.test_torchrun import torchrun_command

pytestmark = pytest.mark.tier("full")  # the launch path: signals to torchrun jobs

LAYOUT = (
    "parallel.tp_size=2",
    "parallel.pp_size=2",
    "train.train_iters=24",
    "optim.lr_decay_iters=100",
    "train.eval_interval=1000",
    "train.eval_iters=1",
)


def command(corpus, run_dir, *extra):
    return [
        *torchrun_command(4),
        os.path.join(REPO_ROOT, "pretrain_gpt.py"),
        *tiny_train_args(corpus, run_dir, *LAYOUT, *extra),
    ]


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's ranks)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    if int(handle.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return found


def trainer_rank(rank: int, world_size: int, argv: list[str]) -> None:
    """One rank of the trainer (tests/conftest.run_ranks), which must exit 0."""
    assert pretrain_gpt.main(argv) == 0


def train_on_ranks(corpus, run_dir, *extra) -> None:
    """The run of `command` (4 ranks, tp 2 x pp 2) on forked gloo ranks instead of torchrun."""
    argv = ["--config", pretrain_gpt.DEFAULT_CONFIG, *tiny_train_args(corpus, run_dir, *LAYOUT, *extra)]
    run_ranks(4, trainer_rank, argv, timeout=300.0)


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_on_ranks(tiny_corpus, run_dir)
    return [r["lm_loss"] for r in read_metrics(run_dir)]


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    """The pids of `pids` still alive after waiting up to `seconds` for them to exit."""
    deadline = time.monotonic() + seconds
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in alive if os.path.exists(f"/proc/{pid}") and not _zombie(pid)]
    return alive


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


@pytest.mark.parametrize(
    "sig,target",
    [
        (signal.SIGTERM, "torchrun"),
        (signal.SIGINT, "torchrun"),
        (signal.SIGUSR1, "ranks"),
        (signal.SIGUSR1, "torchrun"),
        (signal.SIGKILL, "torchrun"),
    ],
    ids=["TERM-torchrun", "INT-torchrun", "USR1-ranks", "USR1-torchrun", "KILL-torchrun"],
)
def test_signal_under_torchrun(tiny_corpus, tmp_path, reference, sig, target):
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen(
        command(tiny_corpus, run_dir), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        for line in proc.stdout:
            if line.startswith("iter ") and "/24" in line:
                break
        ranks = children(proc.pid)
        for pid in [proc.pid] if target == "torchrun" else ranks:
            os.kill(pid, sig)
        # EOF comes when torchrun and every rank (they share its stdout) have exited.
        output = proc.communicate(timeout=240)[0]
        assert not wait_gone(ranks, 60), output[-3000:]
    finally:
        proc.kill()
    saved = checkpoint.read_tracker(os.path.join(run_dir, "checkpoints"))
    assert saved is not None and saved < 24, output[-3000:]
    launcher_died = sig in (signal.SIGUSR1, signal.SIGKILL) and target == "torchrun"
    stopped_by = "SIGTERM" if launcher_died else sig.name
    assert f"stopped by {stopped_by} after iteration {saved}" in output, output[-3000:]
    if launcher_died:
        # torchrun died of the signal; its ranks said why they stopped.
        assert proc.returncode == -sig
        assert f"torchrun (pid {proc.pid}), which started this rank, is gone" in output
    else:
        # torchrun exits 1: signalled itself, it re-raises the signal as SignalException after its ranks are
        # done; when its ranks stop with exit 3 it reports them as failed (ChildFailedError).
        assert proc.returncode == 1
        assert ("exitcode  : 3" in output) if target == "ranks" else (f"got signal: {sig.value}" in output)
    assert [r["iteration"] for r in read_metrics(run_dir)][-1] == saved
    train_on_ranks(tiny_corpus, run_dir, "checkpoint.load=true")
    assert [r["lm_loss"] for r in read_metrics(run_dir)] == reference
