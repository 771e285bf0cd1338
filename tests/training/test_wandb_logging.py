"""Weights & Biases logging (logging.wandb_project), offline: no network, the run is written under run.dir/wandb/.

A trained run's W&B file holds every loss metrics.jsonl holds; a resumed run continues the same W&B run id; the
trainer never imports wandb without the key, and with the key but no wandb installed it refuses in one line.
"""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

import pretrain_gpt
from tests.conftest import REPO_ROOT, tiny_train_args
from training.wandb_logging import RUN_ID_FILE

pytestmark = pytest.mark.tier("fast")


def _wandb_file(run_dir: str, run_id: str) -> list[bytes]:
    paths = sorted(glob.glob(os.path.join(run_dir, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb")))
    return [open(path, "rb").read() for path in paths]


def test_offline_run_logs_every_metric_and_resumes_the_same_run(tiny_corpus, tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # in requirements-dev.txt: CI has it
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = str(tmp_path / "run")
    args = tiny_train_args(tiny_corpus, run_dir, "train.train_iters=4", "logging.wandb_project=ptdp-test")
    assert pretrain_gpt.main(args) == 0
    run_id = open(os.path.join(run_dir, RUN_ID_FILE)).read().strip()
    (first,) = _wandb_file(run_dir, run_id)
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    assert records and b"lm_loss" in first
    for record in records:  # W&B stores each value as its JSON text: the same numbers as metrics.jsonl
        for key in ("lm_loss", "val_loss"):
            if key in record:
                assert json.dumps(record[key]).encode() in first, (key, record)

    assert pretrain_gpt.main([*args, "train.train_iters=6", "checkpoint.load=true"]) == 0
    runs = _wandb_file(run_dir, run_id)
    assert len(runs) == 2, "the resumed run continues the same W&B run id"
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        last = [json.loads(line) for line in handle if "lm_loss" in line][-1]
    assert last["iteration"] == 6 and json.dumps(last["lm_loss"]).encode() in runs[1]


def test_trainer_does_not_import_wandb_without_the_key(tiny_corpus, tmp_path):
    args = tiny_train_args(tiny_corpus, str(tmp_path / "run"), "train.train_iters=3")
    code = f"import sys, pretrain_gpt; assert pretrain_gpt.main({args!r}) == 0; print('wandb' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"


def test_key_without_wandb_is_one_clear_line(tmp_path, monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *rest: None if name == "wandb" else real_find_spec(name, *rest)
    )
    code = pretrain_gpt.main([f"run.dir={tmp_path / 'run'}", "logging.wandb_project=demo"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: logging.wandb_project=demo needs the wandb package: pip install wandb (or drop the key)"]
    assert not os.path.exists(tmp_path / "run")


def test_a_saved_config_with_the_key_validates_without_wandb(monkeypatch):
    """Converting or generating from a run that logged to W&B validates its saved config: that must not need
    wandb (only the trainer's start-up checks that it imports)."""
    from config.schema import Config

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *rest: None if name == "wandb" else real_find_spec(name, *rest)
    )
    config = Config()
    config.logging.wandb_project = "demo"
    config.validate()
