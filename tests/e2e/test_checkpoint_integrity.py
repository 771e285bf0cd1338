"""What the trainer does with checkpoints that are damaged, missing their tracker, from another model, from
another run, or that fail to save: one clear line, exit 2 (bad input) or 1 (a failed save), and nothing of the
run written, overwritten or deleted (except by keep_last)."""
from __future__ import annotations

import errno
import logging
import os
import shutil

import pytest

import pretrain_gpt
from tests.conftest import read_metrics, run_ranks, tiny_train_args
from tools import checkpoint_info
from training.checkpoint import files
from training.logging import LOGGER_NAME


def main(corpus, run_dir, *extra) -> int:
    return pretrain_gpt.main(["--config", pretrain_gpt.DEFAULT_CONFIG, *tiny_train_args(corpus, run_dir, *extra)])


@pytest.fixture
def log_lines():
    """Lines the trainer logs (its logger does not propagate, so capture it directly)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_refused_resumes_are_one_line_and_write_nothing(tiny_corpus, tmp_path, capsys, log_lines):
    run_dir = str(tmp_path / "run")
    assert main(tiny_corpus, run_dir, "train.train_iters=2", "train.eval_iters=0") == 0
    root = os.path.join(run_dir, "checkpoints")
    iter_dir = os.path.join(root, "iter_0000002")
    config_yaml = open(os.path.join(run_dir, "config.yaml")).read()
    capsys.readouterr()
    resume = ("train.train_iters=4", "train.eval_iters=0", "checkpoint.load=true")

    data = os.path.join(iter_dir, "__0_0.distcp")
    original = open(data, "rb").read()
    with open(data, "r+b") as handle:  # one flipped byte in the middle of the tensor data
        handle.seek(len(original) // 2)
        handle.write(bytes([original[len(original) // 2] ^ 0x10]))
    assert main(tiny_corpus, run_dir, *resume) == 2
    line = one_error_line(capsys)
    assert data in line and "checksum" in line
    assert checkpoint_info.main([iter_dir, "--verify"]) == 1
    assert data in capsys.readouterr().err
    open(data, "wb").write(original)

    assert main(tiny_corpus, run_dir, *resume, "model.hidden_size=64", "model.num_layers=2") == 2
    line = one_error_line(capsys)
    assert "model.num_layers=4 in the checkpoint, 2 in this run" in line
    assert "model.hidden_size=32 in the checkpoint, 64 in this run" in line

    assert main(tiny_corpus, run_dir, "train.train_iters=1", "optim.lr_warmup_iters=1", "checkpoint.load=true") == 2
    assert "train.train_iters=1 is below the iteration of checkpoint" in one_error_line(capsys)

    for bad in (str(tmp_path / "nowhere"), str(tmp_path)):
        assert main(tiny_corpus, run_dir, *resume, f"checkpoint.load={bad}") == 2
        assert bad in one_error_line(capsys)

    assert main(tiny_corpus, run_dir, "train.train_iters=4") == 2  # a fresh run would write over iter_0000002
    assert "already holds checkpoints" in one_error_line(capsys)
    assert open(os.path.join(run_dir, "config.yaml")).read() == config_yaml

    os.remove(os.path.join(root, files.TRACKER))  # no tracker: the newest complete checkpoint, not a fresh start
    stale = os.path.join(root, "iter_0000004.tmp.999999999")  # a save whose process is gone
    os.makedirs(stale)
    assert main(tiny_corpus, run_dir, *resume) == 0
    assert not os.path.exists(stale)
    assert any("removed" in line and stale in line for line in log_lines)
    assert [r["iteration"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert files.read_tracker(root) == 4 and checkpoint_info.main([root, "--verify"]) == 0


def test_failed_save_is_one_line_and_keeps_the_previous_checkpoint(tiny_corpus, tmp_path, capsys, monkeypatch):
    run_dir = str(tmp_path / "run")
    args = ("train.train_iters=4", "train.eval_iters=0", "checkpoint.save_interval=2")
    real = files.checksum_files
    calls = []

    def disk_full(directory, names):
        calls.append(directory)
        if len(calls) > 1:  # the second save (iteration 4) hits a full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(directory, names[0]))
        return real(directory, names)

    monkeypatch.setattr(files, "checksum_files", disk_full)
    assert main(tiny_corpus, run_dir, *args) == 1
    line = one_error_line(capsys)
    assert "checkpoint save at iteration 4 failed" in line and "No space left on device" in line
    root = os.path.join(run_dir, "checkpoints")
    assert files.read_tracker(root) == 2
    assert sorted(os.listdir(root)) == ["iter_0000002", "latest", files.TRACKER]  # no .tmp left behind


def test_async_save_keep_last_and_lr_schedule_rule(tiny_corpus, tmp_path, log_lines):
    run_dir = str(tmp_path / "run")
    assert main(tiny_corpus, run_dir, "train.train_iters=4", "train.eval_iters=0", "checkpoint.save_interval=1",
                "checkpoint.async_save=true", "checkpoint.keep_last=2") == 0
    root = os.path.join(run_dir, "checkpoints")
    assert files.list_iterations(root) == [3, 4] and files.read_tracker(root) == 4
    saves = [line for line in log_lines if line.startswith("saved checkpoint")]
    assert len(saves) == 4 and all("MiB, async" in s and "training loop blocked" in s for s in saves)
    log_lines.clear()
    # Longer run on resume: the checkpoint's LR schedule wins (logged), unless optim.override_lr_schedule.
    assert main(tiny_corpus, run_dir, "train.train_iters=6", "train.eval_iters=0", "checkpoint.load=true") == 0
    assert any("LR schedule: decay_iters=4 from the checkpoint, not this run's 6" in line for line in log_lines)
    shutil.rmtree(os.path.join(root, "iter_0000006"))
    files.write_trackers(root, 4)
    log_lines.clear()
    assert main(tiny_corpus, run_dir, "train.train_iters=6", "train.eval_iters=0", "checkpoint.load=true",
                "optim.override_lr_schedule=true") == 0
    assert any("LR schedule: decay_iters=6 from this run's config" in line for line in log_lines)


def _rank_main(rank, world_size, argv):
    assert pretrain_gpt.main(argv) == 0


def test_finetune_from_another_run_at_another_layout(tiny_corpus, tmp_path, log_lines):
    source = str(tmp_path / "pretrain")
    assert main(tiny_corpus, source, "train.train_iters=2", "train.eval_iters=0") == 0
    target = str(tmp_path / "finetune")
    argv = ["--config", pretrain_gpt.DEFAULT_CONFIG,
            *tiny_train_args(tiny_corpus, target, "train.train_iters=2", "train.eval_iters=0",
                             "parallel.tp_size=2", f"checkpoint.load={source}/checkpoints", "checkpoint.finetune=true")]
    run_ranks(2, _rank_main, argv, timeout=300.0)
    assert [r["iteration"] for r in read_metrics(target)] == [1, 2]
    assert files.read_tracker(os.path.join(target, "checkpoints")) == 2
    assert files.read_tracker(os.path.join(source, "checkpoints")) == 2  # the source is untouched
