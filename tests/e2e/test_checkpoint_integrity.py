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
from checkpoint import files
from operations.log import LOGGER_NAME
from tests.conftest import read_metrics, run_ranks, tiny_train_args
from tools import checkpoint_info

pytestmark = pytest.mark.tier("full")  # the launch path: kill -9 during saves


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
    assert (
        main(
            tiny_corpus,
            run_dir,
            "train.train_iters=4",
            "train.eval_iters=0",
            "checkpoint.save_interval=1",
            "checkpoint.async_save=true",
            "checkpoint.keep_last=2",
        )
        == 0
    )
    root = os.path.join(run_dir, "checkpoints")
    assert files.list_iterations(root) == [3, 4] and files.read_tracker(root) == 4
    saves = [line for line in log_lines if line.startswith("saved checkpoint")]
    assert len(saves) == 4 and all("MiB, async, copied aside in" in s and "training loop blocked" in s for s in saves)
    log_lines.clear()
    # Longer run on resume: the checkpoint's LR schedule wins (logged), unless optim.override_lr_schedule.
    assert main(tiny_corpus, run_dir, "train.train_iters=6", "train.eval_iters=0", "checkpoint.load=true") == 0
    assert any("LR schedule: decay_iters=4 from the checkpoint, not this run's 6" in line for line in log_lines)
    shutil.rmtree(os.path.join(root, "iter_0000006"))
    files.write_trackers(root, 4)
    log_lines.clear()
    assert (
        main(
            tiny_corpus,
            run_dir,
            "train.train_iters=6",
            "train.eval_iters=0",
            "checkpoint.load=true",
            "optim.override_lr_schedule=true",
        )
        == 0
    )
    assert any("LR schedule: decay_iters=6 from this run's config" in line for line in log_lines)


def _rank_main(rank, world_size, argv):
    assert pretrain_gpt.main(argv) == 0


def test_finetune_from_another_run_at_another_layout(tiny_corpus, tmp_path, log_lines):
    source = str(tmp_path / "pretrain")
    assert main(tiny_corpus, source, "train.train_iters=2", "train.eval_iters=0") == 0
    target = str(tmp_path / "finetune")
    argv = [
        "--config",
        pretrain_gpt.DEFAULT_CONFIG,
        *tiny_train_args(
            tiny_corpus,
            target,
            "train.train_iters=2",
            "train.eval_iters=0",
            "parallel.tp_size=2",
            f"checkpoint.finetune={source}/checkpoints",
        ),
    ]  # one override
    run_ranks(2, _rank_main, argv, timeout=300.0)
    assert [r["iteration"] for r in read_metrics(target)] == [1, 2]
    assert files.read_tracker(os.path.join(target, "checkpoints")) == 2
    assert files.read_tracker(os.path.join(source, "checkpoints")) == 2  # the source is untouched


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_9_during_saves_leaves_a_loadable_checkpoint(tiny_corpus, tmp_path, mode):
    """Two kills per mode here; scripts/checkpoint_kill_test.py does ten (docs/performance.md)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(pretrain_gpt.__file__), "scripts"))
    import checkpoint_kill_test

    data_args = [
        f"data.data_path=[{tiny_corpus['data_prefix']}]",
        f"data.vocab_file={tiny_corpus['vocab_file']}",
        f"data.merge_file={tiny_corpus['merge_file']}",
        "model.make_vocab_size_divisible_by=8",
    ]
    # The second round starts by resuming the first round's checkpoint in the trainer (load=true).
    result = checkpoint_kill_test.run(2, mode, str(tmp_path), data_args, seed=1, final_resume=False)
    assert result["latest"] >= 2


def _write_legacy_checkpoint(run, root: str) -> None:
    """Format 1 (per-rank files, as earlier versions wrote them) of a single-process run."""
    import torch

    directory = os.path.join(root, f"iter_{run.progress.iteration:07d}", "mp_rank_00_000")
    os.makedirs(directory)
    torch.save(
        {
            "iteration": run.progress.iteration,
            "consumed_samples": run.progress.consumed_samples,
            "skipped_iters": 0,
            "config": run.config.to_dict(),
            "model": [chunk.state_dict() for chunk in run.ctx.chunks],
            "lr_schedule": run.lr_schedule.state_dict(),
            "optimizer": run.ctx.optimizer.state_dict(),
            "layout": {"tp": 1, "pp": 1, "vp": 1},
        },
        os.path.join(directory, "model_optim_rng.pt"),
    )
    torch.save({"rng": run.rng_tracker.state_dict(), "optimizer": None}, os.path.join(directory, "dp_rank_000.pt"))
    files.write_trackers(root, run.progress.iteration)


def test_legacy_per_rank_checkpoint_still_resumes(tiny_corpus, tmp_path, log_lines):
    from config.schema import load_config
    from operations.startup import init_distributed
    from parallel.layout import layout_from_config
    from training.loop import train
    from training.run import build_run

    drop = ("model.hidden_dropout=0.1", "train.eval_iters=0")
    whole, legacy = str(tmp_path / "whole"), str(tmp_path / "legacy")
    assert main(tiny_corpus, whole, "train.train_iters=4", *drop) == 0
    config = load_config(
        pretrain_gpt.DEFAULT_CONFIG,
        tiny_train_args(tiny_corpus, legacy, "train.train_iters=2", *drop, "checkpoint.save=false"),
    )
    run = build_run(config, init_distributed(), layout_from_config(config, 1))
    train(run)
    _write_legacy_checkpoint(run, os.path.join(legacy, "checkpoints"))
    assert main(tiny_corpus, legacy, "train.train_iters=4", *drop, "checkpoint.load=true") == 0
    assert any("per-rank format of earlier versions" in line for line in log_lines)
    assert [r["lm_loss"] for r in read_metrics(legacy)] == [r["lm_loss"] for r in read_metrics(whole)]
    assert checkpoint_info.main([os.path.join(legacy, "checkpoints"), "--verify"]) == 0  # saved in format 2
