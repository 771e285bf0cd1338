"""The trainer against hostile input: a diverging lr, token ids outside the vocabulary, a second trainer in the
same run.dir, a torn metrics.jsonl, a resume that finds no checkpoint."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import checkpoint
import pretrain_gpt
from convert.model_weights import load_global_state
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from operations.guards import EXIT_DIVERGED, EXIT_INPUT_ERROR
from tests.conftest import REPO_ROOT, read_metrics, tiny_train_args

pytestmark = pytest.mark.tier("fast")


def run_main(corpus, run_dir, *extra):
    return pretrain_gpt.main(["--config", pretrain_gpt.DEFAULT_CONFIG, *tiny_train_args(corpus, run_dir, *extra)])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_huge_lr_stops_within_a_few_iterations_and_leaves_finite_checkpoints(tiny_corpus, tmp_path, capsys, precision):
    run_dir = str(tmp_path / "run")
    code = run_main(
        tiny_corpus,
        run_dir,
        "optim.lr=1e6",
        "optim.min_lr=0",
        f"train.precision={precision}",
        "train.train_iters=30",
        "checkpoint.save_interval=1",
        "optim.initial_loss_scale=4",
        "optim.hysteresis=1",
    )
    assert code == EXIT_DIVERGED
    line = one_error_line(capsys)
    # fp32/bf16: nan losses in a row; fp16: the 16-bit copy of the weights overflows first, caught at the save.
    assert "training diverged" in line
    assert "train.max_nonfinite_iters=3" in line or (precision == "fp16" and "are not finite, so no checkpoint" in line)
    stopped_at = read_metrics(run_dir)[-1]["iteration"]
    assert stopped_at <= 10
    root = os.path.join(run_dir, "checkpoints")
    last = checkpoint.read_tracker(root)
    assert last is not None and last < stopped_at
    _, saved = load_global_state(os.path.join(root, f"iter_{last:07d}"))  # every weight, global names
    assert saved
    for name, tensor in saved.items():
        assert torch.isfinite(tensor.float()).all(), name
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]  # valid JSON throughout
    if "max_nonfinite_iters" in line:  # the non-finite losses / grad norms were logged as null, flagged
        assert any(r.get("nonfinite") for r in lines)


def corpus_with_bad_ids(corpus: dict, root: str, bad_id: int, every: int = 97) -> str:
    """A copy of the tiny corpus where every `every`-th token of every document is `bad_id`."""
    source = IndexedDataset(corpus["data_prefix"])
    prefix = os.path.join(root, "bad_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for i in range(len(source)):
        tokens = np.array(source[i], dtype=np.int32)
        tokens[every // 2 :: every] = bad_id
        builder.add_document(tokens)
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize("bad_id", [520, 600], ids=["inside-the-padding", "past-the-padded-vocabulary"])
def test_out_of_vocabulary_ids_stop_at_the_first_bad_batch(tiny_corpus, tmp_path, capsys, bad_id):
    """Vocabulary 512 padded to 528 (make_vocab_size_divisible_by=48): ids 520 and 600 are both refused."""
    prefix = corpus_with_bad_ids(tiny_corpus, str(tmp_path), bad_id)
    run_dir = str(tmp_path / "run")
    code = run_main(
        tiny_corpus,
        run_dir,
        f"data.data_path=[{prefix}]",
        "model.make_vocab_size_divisible_by=48",
        "train.eval_iters=0",
    )
    assert code == EXIT_INPUT_ERROR
    line = one_error_line(capsys)
    assert f"token id {bad_id} in document" in line and prefix in line and "model.vocab_size" in line
    document, offset = (
        int(x) for x in line.split("in document ")[1].split(" of ")[0:1] + line.split("(token ")[1].split()[0:1]
    )
    assert IndexedDataset(prefix)[document][offset] == bad_id  # the line points at the real token
    assert checkpoint.read_tracker(os.path.join(run_dir, "checkpoints")) is None
    assert not read_metrics(run_dir) if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else True


def test_second_trainer_in_a_live_run_dir_is_refused(tiny_corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; sys.path.insert(0, sys.argv[1]); "
            "from operations.run_lock import RunLock; RunLock(sys.argv[2]).acquire(); "
            "print('held', flush=True); time.sleep(120)",
            REPO_ROOT,
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert run_main(tiny_corpus, str(run_dir), "train.train_iters=2") == EXIT_INPUT_ERROR
        line = one_error_line(capsys)
        assert f"in use by another trainer: pid {holder.pid} on host" in line
        assert not (run_dir / "metrics.jsonl").exists()
        holder.kill()
        holder.wait()
        assert run_main(tiny_corpus, str(run_dir), "train.train_iters=2") == 0  # kill -9 left a stale lock
        assert "removed the stale lock of pid" in capsys.readouterr().err
        assert not (run_dir / "run.lock").exists()
    finally:
        holder.kill()


def test_resume_drops_a_torn_line_and_fresh_start_keeps_no_duplicates(tiny_corpus, tmp_path):
    run_dir = str(tmp_path / "run")
    assert run_main(tiny_corpus, run_dir, "train.train_iters=3") == 0
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path, "a") as handle:
        handle.write('{"iteration": 4, "lm_loss": 1.2')  # the disk filled up mid-line
    assert run_main(tiny_corpus, run_dir, "train.train_iters=5", "checkpoint.load=true") == 0
    assert [r["iteration"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5]

    fresh = str(tmp_path / "fresh")
    assert run_main(tiny_corpus, fresh, "train.train_iters=3", "checkpoint.save=false") == 0
    assert run_main(tiny_corpus, fresh, "train.train_iters=3", "checkpoint.load=true") == 0  # finds none
    assert [r["iteration"] for r in read_metrics(fresh)] == [1, 2, 3]
    assert os.path.exists(os.path.join(fresh, "metrics.jsonl.1"))
