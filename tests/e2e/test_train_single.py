"""The trainer on one process: it learns, writes its metrics, resumes exactly, survives a crash mid-save."""

import json
import os

import pytest
import torch

import checkpoint
import pretrain_gpt
from tests.conftest import read_metrics, tiny_train_args
from training import loop

pytestmark = pytest.mark.tier("fast")


def train(corpus, run_dir, *extra):
    assert pretrain_gpt.main(["--config", pretrain_gpt.DEFAULT_CONFIG, *tiny_train_args(corpus, run_dir, *extra)]) == 0


def test_metrics_file_and_run_dir(tiny_corpus, tmp_path):
    run_dir = str(tmp_path / "run")
    train(tiny_corpus, run_dir, "train.train_iters=6", "logging.log_interval=3", "logging.tensorboard=true")
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train_lines = [r for r in lines if "lm_loss" in r]
    assert [r["iteration"] for r in train_lines] == [3, 6]
    for record in train_lines:
        assert {"iteration", "lm_loss", "lr", "grad_norm", "tokens_per_sec", "consumed_samples"} <= set(record)
    evals = [r for r in lines if "val_loss" in r]
    assert [r["iteration"] for r in evals] == [0, 5, 6] and all("val_ppl" in r for r in evals)
    assert os.path.exists(os.path.join(run_dir, "config.yaml"))
    assert os.listdir(os.path.join(run_dir, "tensorboard"))
    assert checkpoint.read_tracker(os.path.join(run_dir, "checkpoints")) == 6


def test_exact_resume_is_bitwise(tiny_corpus, tmp_path):
    """20 iterations in one go == 10, exit, resume for 10 more (fp32, CPU), dropout on."""
    drop = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", "train.train_iters=20"]
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    train(tiny_corpus, whole, *drop)
    train(tiny_corpus, split, *drop, "train.exit_interval=10")
    assert checkpoint.read_tracker(os.path.join(split, "checkpoints")) == 10
    train(tiny_corpus, split, *drop, "checkpoint.load=true")
    expected = [r["lm_loss"] for r in read_metrics(whole)]
    resumed = [r["lm_loss"] for r in read_metrics(split)]
    assert len(expected) == 20 and resumed == expected  # bitwise, iterations 11-20 included


def test_crash_mid_save_keeps_previous_checkpoint(tiny_corpus, tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    train(tiny_corpus, run_dir, "train.train_iters=4", "checkpoint.save_interval=2")
    root = os.path.join(run_dir, "checkpoints")
    assert checkpoint.read_tracker(root) == 4

    real_save = checkpoint.save_checkpoint

    def crashing_save(*args, **kwargs):
        def crash():
            raise KeyboardInterrupt("killed between the files and the tracker")

        return real_save(*args, **kwargs, before_tracker=crash)

    monkeypatch.setattr(loop, "save_checkpoint", crashing_save)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_corpus, run_dir, "train.train_iters=6", "checkpoint.save_interval=2", "checkpoint.load=true")
    assert checkpoint.read_tracker(root) == 4  # the half-written iteration 6 is not the one that loads
    monkeypatch.undo()
    train(tiny_corpus, run_dir, "train.train_iters=6", "checkpoint.load=true")
    assert checkpoint.read_tracker(root) == 6


def test_torn_file_is_reported_with_its_name(tiny_corpus, tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    train(tiny_corpus, run_dir, "train.train_iters=2")
    path = os.path.join(run_dir, "checkpoints", "iter_0000002", "__0_0.distcp")
    config_before = open(os.path.join(run_dir, "config.yaml")).read()
    with open(path, "r+b") as handle:
        handle.truncate(100)
    code = pretrain_gpt.main(
        [
            "--config",
            pretrain_gpt.DEFAULT_CONFIG,
            *tiny_train_args(tiny_corpus, run_dir, "train.train_iters=4", "checkpoint.load=true", "train.seed=5"),
        ]
    )
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and path in error[0] and "truncated" in error[0], error
    assert open(os.path.join(run_dir, "config.yaml")).read() == config_before  # a refused resume writes nothing


def test_missing_data_is_one_line_and_leaves_no_run_folder(tiny_corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = tiny_train_args(tiny_corpus, str(run_dir)) + ["data.data_path=[/nonexistent/corpus_text_document]"]
    assert pretrain_gpt.main(["--config", pretrain_gpt.DEFAULT_CONFIG, *args]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "/nonexistent/corpus_text_document" in error[0]
    assert not run_dir.exists()


def test_fp16_and_bf16_train(tiny_corpus, tmp_path):
    """Each 16-bit run logs every iteration, stays near the fp32 losses and is not the fp32 run."""
    runs = {}
    for precision in ("fp32", "bf16", "fp16"):
        run_dir = str(tmp_path / precision)
        # fp16 starts at a loss scale that does not overflow (the default 2**32 skips ~16 steps first).
        train(
            tiny_corpus, run_dir, f"train.precision={precision}", "train.train_iters=6", "optim.initial_loss_scale=4096"
        )
        records = read_metrics(run_dir)
        assert [r["iteration"] for r in records] == list(range(1, 7))
        runs[precision] = torch.tensor([r["lm_loss"] for r in records])
    for precision in ("bf16", "fp16"):
        assert torch.isfinite(runs[precision]).all()
        torch.testing.assert_close(runs[precision], runs["fp32"], rtol=2e-2, atol=0.0)
        assert not torch.equal(runs[precision], runs["fp32"])  # the 16-bit path really ran


def test_pipeline_plans_are_built_once_per_run(tiny_corpus, tmp_path, monkeypatch):
    """The joint communication plan is built for training and for evaluation once, not per step."""
    from parallel.pipeline import plan

    calls = []
    real_plan_steps = plan.plan_steps

    def counting_plan_steps(*args, **kwargs):
        calls.append(args)
        return real_plan_steps(*args, **kwargs)

    monkeypatch.setattr(plan, "plan_steps", counting_plan_steps)
    run_dir = str(tmp_path / "run")
    train(tiny_corpus, run_dir, "train.train_iters=6", "train.eval_interval=2")
    assert len(read_metrics(run_dir)) == 6
    assert len(calls) == 2  # one train plan, one evaluation plan, for 6 steps and 4 evaluations
