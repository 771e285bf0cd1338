"""Hangs and stragglers, found and named (issue 32's acceptance), on 4 real gloo ranks:

1. tp2 x pp2 under torchrun, PTDP_INJECT_FAULT=rank=2,iteration=5,kind=sleep, parallel.train_timeout_s=10: every
   rank exits 5 within the timeout + 30 s of the stall, tools/diagnose_hang.py names rank 2, the collective and
   iteration 5, the last checkpoint (iteration 4) stays the latest, and resuming from it gives the uninterrupted
   run's losses (the uninterrupted reference and the resume check the checkpoint, not the launcher: they run
   the same trainer and layout on 4 gloo ranks of tests/conftest.run_ranks, as test_torchrun_signals.py's do,
   instead of two more torchrun starts of ~15-25 CPU s each);
2. the same with kind=skip: diagnose_hang names rank 2 and the sequence number where the ranks part;
3. dp4, rank 1 twice as slow: the straggler report names it in its first report and warns in the second
   (forked ranks: the report reads the ranks' step times over gloo, not the launcher);
4. a healthy run that saves every iteration (sync and async), with saves slower than a small train_timeout_s
   plus the watchdog's grace: no timeout fires (forked ranks: the slow save is a patched function).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time

import pytest
import torch.multiprocessing as mp

import checkpoint
import pretrain_gpt
from checkpoint import saver
from operations.diagnostics import read_dumps
from operations.guards import EXIT_HUNG
from operations.watchdog import WATCHDOG_GRACE_S
from tests.conftest import REPO_ROOT, free_port, read_metrics, run_ranks, tiny_train_args
from tests.e2e.test_torchrun import torchrun_command
from tests.e2e.test_torchrun_signals import trainer_rank
from tools import diagnose_hang

pytestmark = pytest.mark.tier("full")  # the launch path: hangs waited out to their timeouts

TRAIN_TIMEOUT_S = 10  # waited out twice (stall, skip): at 20 s it cost the suite 20 s more of waiting
LAYOUT = (
    "parallel.tp_size=2",
    "parallel.pp_size=2",
    "train.train_iters=8",
    "train.eval_interval=1000",
    "train.eval_iters=1",
    "checkpoint.save_interval=2",
    f"parallel.train_timeout_s={TRAIN_TIMEOUT_S}",
)
RANK2 = "rank 2 (tp 0, cp 0, dp 0, pp 1)"


def command(corpus: dict, run_dir: str, *extra: str) -> list[str]:
    return [*torchrun_command(4), os.path.join(REPO_ROOT, "pretrain_gpt.py"), *tiny_train_args(corpus, run_dir, *extra)]


def train_on_ranks(corpus: dict, run_dir: str, *extra: str) -> None:
    """The run of `command` on 4 gloo ranks of the rank pool instead of torchrun (each rank must exit 0)."""
    argv = ["--config", pretrain_gpt.DEFAULT_CONFIG, *tiny_train_args(corpus, run_dir, *extra)]
    run_ranks(4, trainer_rank, argv, timeout=300.0)


def run_torchrun(argv: list[str], fault: str, marker: str, timeout: float = 300.0) -> tuple[int, str, float | None]:
    """Run torchrun with PTDP_INJECT_FAULT=`fault`; returns its exit code, its output and the seconds from the
    first line holding `marker` (the fault taking effect) to the end of every process."""
    env = {**os.environ, "PTDP_INJECT_FAULT": fault}
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    lines, marked = [], None
    try:
        for line in proc.stdout:  # EOF once torchrun and every rank (they share its stdout) have exited
            lines.append(line)
            if marked is None and marker in line:
                marked = time.monotonic()
        proc.wait()
    finally:
        killer.cancel()
    ended = time.monotonic()
    return proc.returncode, "".join(lines), None if marked is None else ended - marked


def rank0_failed_seq(run_dir: str) -> int:
    """The sequence number of the world all-reduce rank 0 timed out in (from its dump)."""
    with open(os.path.join(run_dir, "diagnostics", "rank_00000.json"), encoding="utf-8") as handle:
        dump = json.load(handle)
    failed = [r for r in dump["records"] if r["state"] == "failed"]
    assert failed and failed[-1]["group"] == "world" and failed[-1]["iteration"] == 5, failed
    return failed[-1]["seq"]


def diagnosis(run_dir: str, capsys) -> str:
    capsys.readouterr()
    assert diagnose_hang.main([run_dir]) == 0
    return capsys.readouterr().out


def hung_run(corpus: dict, run_dir: str, kind: str, marker: str, capsys) -> str:
    """The tp2 x pp2 run with rank 2's fault `kind` at iteration 5: every rank exits 5 within the training timeout
    + 30 s of the fault taking effect (the line holding `marker`). Returns the output."""
    started = time.monotonic()
    code, output, after_fault = run_torchrun(
        command(corpus, run_dir, *LAYOUT), f"rank=2,iteration=5,kind={kind}", marker
    )
    assert after_fault is not None, output[-3000:]
    with capsys.disabled():  # the figure for docs/operations.md, on the terminal
        print(
            f"\n{kind}: the job ended {after_fault:.1f} s after the fault ({time.monotonic() - started:.1f} s in all)"
        )
    assert code == 1, output[-3000:]  # torchrun exits 1 when its ranks fail; each rank's code is in its summary
    assert output.count(f"exitcode  : {EXIT_HUNG} ") == 4, output[-3000:]
    assert after_fault <= TRAIN_TIMEOUT_S + 30, output[-3000:]
    return output


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_on_ranks(tiny_corpus, run_dir, *LAYOUT)
    return [r["lm_loss"] for r in read_metrics(run_dir)]


def test_a_stalled_rank_is_named_and_the_run_resumes_from_its_last_checkpoint(tiny_corpus, tmp_path, reference, capsys):
    run_dir = str(tmp_path / "run")
    output = hung_run(tiny_corpus, run_dir, "sleep", "PTDP_INJECT_FAULT: rank 2 stalls", capsys)
    assert f"error: {RANK2} at iteration 5: no progress for " in output  # its watchdog
    seq = rank0_failed_seq(run_dir)
    assert (
        f"{RANK2} did not reach all_reduce #{seq} (24 B, iteration 5, boundary) on world [0, 1, 2, 3], which "
        f"ranks 0, 1, 3 entered: it is stuck outside any collective (watchdog: "
    ) in diagnosis(run_dir, capsys)
    root = os.path.join(run_dir, "checkpoints")
    assert checkpoint.read_tracker(root) == 4
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004", "latest", "latest_checkpointed_iteration.txt"]
    train_on_ranks(tiny_corpus, run_dir, *LAYOUT, "checkpoint.load=true")
    assert [r["lm_loss"] for r in read_metrics(run_dir)] == reference
    moved = os.path.join(run_dir, "diagnostics.1")  # the hang's dumps, set aside by the new attempt
    assert os.path.isdir(moved)
    assert diagnosis(run_dir, capsys).startswith(
        f"{os.path.join(run_dir, 'diagnostics')} holds no dumps: reading {moved}"
    )
    attempts = {(dump["run"], dump["run_started"]) for dump in read_dumps(moved)}
    assert len(attempts) == 1, attempts  # every rank named the same attempt: rank 0's


def test_a_skipped_collective_is_where_the_ranks_part(tiny_corpus, tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    hung_run(tiny_corpus, run_dir, "skip", "PTDP_INJECT_FAULT: rank 2 leaves out", capsys)
    seq = rank0_failed_seq(run_dir)
    assert (
        f"the ranks part on world [0, 1, 2, 3] at #{seq}: ranks 0, 1, 3 entered all_reduce #{seq} (24 B, "
        f"iteration 5, boundary); {RANK2} went on without it (skipped it)"
    ) in diagnosis(run_dir, capsys)
    assert checkpoint.read_tracker(os.path.join(run_dir, "checkpoints")) == 4


def test_a_rank_twice_as_slow_is_named_by_the_straggler_report(tiny_corpus, tmp_path, capfd):
    """On 4 forked gloo ranks rather than torchrun (one launch of 5 processes less): the same trainer, fault hook
    and report; its lines are read from the ranks' output (inherited file descriptors)."""
    run_dir = str(tmp_path / "run")
    interval = 3
    overrides = (
        "train.train_iters=6",
        f"logging.straggler_interval={interval}",
        "logging.log_interval=3",
        "checkpoint.save=false",
        "train.eval_iters=0",
        "model.hidden_size=192",  # enough compute per step that the doubling stands well above the noise
        "model.seq_length=128",
    )
    argv = ["--config", pretrain_gpt.DEFAULT_CONFIG, *tiny_train_args(tiny_corpus, run_dir, *overrides)]
    codes = run_forked_trainer(argv, fault="rank=1,iteration=1,kind=slow")
    captured = capfd.readouterr()
    output = captured.out + captured.err
    assert codes == [0, 0, 0, 0], output[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        reports = [r for r in map(json.loads, handle) if "straggler_slowest_rank" in r]
    assert [r["iteration"] for r in reports] == [3, 6]
    assert reports[0]["straggler_slowest_rank"] == 1, reports  # named in the first report
    assert re.search(r"slowest rank 1 \(tp 0, cp 0, dp 1, pp 0\) compute [\d.]+ ms, wait [\d.]+ ms", output)
    assert "warning: rank 1 (tp 0, cp 0, dp 1, pp 0) is a straggler: compute " in output  # by the second


def _forked_rank(rank: int, world_size: int, port: int, argv: list[str], fault: str) -> None:
    """One rank of a forked run of the trainer, exiting with its code (os._exit: no gloo teardown). The trainer
    reads LOCAL_RANK / LOCAL_WORLD_SIZE with defaults that fit one CPU node."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ["PTDP_INJECT_FAULT"] = fault
    os._exit(pretrain_gpt.main(argv))


def run_forked_trainer(argv: list[str], fault: str = "", world_size: int = 4) -> list[int | None]:
    """The trainer on `world_size` ranks forked from this process (patches made here apply to them);
    PTDP_INJECT_FAULT=`fault` in each. Returns their exit codes."""
    args = (world_size, free_port(), argv, fault)
    context = mp.start_processes(_forked_rank, args=args, nprocs=world_size, join=False, start_method="fork")
    for process in context.processes:
        process.join(240)
    return [process.exitcode for process in context.processes]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_no_timeout_fires_on_a_healthy_run_that_saves_every_iteration(tiny_corpus, tmp_path, monkeypatch, async_save):
    run_dir = str(tmp_path / "run")
    timeout_s, slow_save_s = 3, 3 + WATCHDOG_GRACE_S + 2  # one save outlasts the timeout and the watchdog's grace
    finalize = saver._finalize

    def slow_finalize(job, *args):
        if job.iteration == 2:
            time.sleep(slow_save_s)  # rank 0, after the files and before the rename: the others wait for it
        return finalize(job, *args)

    monkeypatch.setattr(saver, "_finalize", slow_finalize)
    overrides = (
        "parallel.tp_size=2",
        "train.train_iters=4",
        "train.eval_iters=0",
        "checkpoint.save_interval=1",
        f"checkpoint.async_save={str(async_save).lower()}",
        f"parallel.train_timeout_s={timeout_s}",
        "logging.straggler_interval=2",
    )
    argv = ["--config", pretrain_gpt.DEFAULT_CONFIG, *tiny_train_args(tiny_corpus, run_dir, *overrides)]
    assert run_forked_trainer(argv) == [0, 0, 0, 0]
    assert not os.path.exists(os.path.join(run_dir, "diagnostics"))
    root = os.path.join(run_dir, "checkpoints")
    assert checkpoint.read_tracker(root) == 4
    assert [name for name in sorted(os.listdir(root)) if name.startswith("iter_")] == [
        f"iter_000000{i}" for i in range(1, 5)
    ]
