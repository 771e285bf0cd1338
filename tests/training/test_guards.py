"""Run guards without a trainer: the run lock, token checks and their location in the data, the non-finite
counter, metrics.jsonl line safety, device checks."""

import json
import logging
import math
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from config.schema import TrainConfig
from data.blended_dataset import BlendedDataset
from data.gpt_dataset import GPTDataset, TokenSource
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from data.loader import build_data_iterator
from data.microbatch import Microbatch
from operations.guards import NonFiniteGuard, TrainingStopped, bad_token_message, find_bad_token
from operations.log import LOGGER_NAME
from operations.run_lock import RunLock, RunLockError
from operations.startup import check_devices
from tests.data.options import BUILD, SAMPLES
from training.logging import MetricsWriter

pytestmark = pytest.mark.tier("fast")


# ---- run lock ------------------------------------------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lock_refuses_a_second_trainer_naming_pid_and_host(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; sys.path.insert(0, sys.argv[1]); "
            "from operations.run_lock import RunLock; RunLock(sys.argv[2]).acquire(); "
            "print('held', flush=True); time.sleep(120)",
            os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(RunLockError) as err:
            RunLock(str(tmp_path)).acquire()
        assert time.monotonic() - started < 5
        assert f"pid {holder.pid} on host {socket.gethostname()}" in str(err.value)
        holder.kill()  # kill -9: the lock file stays, and is detected as stale
        holder.wait()
        lock = RunLock(str(tmp_path))
        lock.acquire()
        assert lock.broke_stale["pid"] == holder.pid
        lock.release()
        assert not os.path.exists(lock.path)
    finally:
        holder.kill()


def _write_lock(tmp_path, **record) -> None:
    (tmp_path / "run.lock").write_text(json.dumps(record))


def test_stale_and_foreign_locks(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _write_lock(tmp_path, host=socket.gethostname(), pid=_dead_pid(), start_ticks=1)
    RunLock(str(tmp_path)).acquire()  # dead process on this host: stale
    _write_lock(tmp_path, host=socket.gethostname(), pid=os.getpid(), start_ticks=1)
    RunLock(str(tmp_path)).acquire()  # this pid now belongs to another process (start time differs): stale
    _write_lock(tmp_path, host="other-node", pid=1234, slurm_job_id="77")
    with pytest.raises(RunLockError, match="pid 1234 on host other-node"):
        RunLock(str(tmp_path)).acquire()  # cannot be checked from here: never broken silently
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    RunLock(str(tmp_path)).acquire()  # the same SLURM job, requeued onto other nodes: the old attempt is gone


# ---- token ids ---------------------------------------------------------------------------------------
def _dataset(tmp_path, documents):
    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in documents:
        builder.add_document(doc)
    builder.finalize(prefix + ".idx")
    return GPTDataset(IndexedDataset(prefix), "train", (0, len(documents)), 4, 1, 20, None, SAMPLES)


def ids_only(text: torch.Tensor) -> Microbatch:
    """A micro-batch of samples `text` [b, s + 1] (tokens and labels; every position weighs in the loss)."""
    positions = torch.arange(text.shape[1] - 1).expand(text.shape[0], -1)
    return Microbatch.of(text[:, :-1], text[:, 1:], torch.ones(positions.shape), positions)


def test_bad_token_is_found_and_located_in_its_document(tmp_path):
    docs = [list(range(10, 17)), [20, 21, 22], list(range(30, 41))]
    docs[2][5] = 999  # document 2, offset 5
    dataset = _dataset(tmp_path, docs)
    blend = BlendedDataset(
        [dataset], [1.0], len(dataset), None, BUILD.mid_level_surplus
    )  # one component: blend sample i is sample i
    for sample in range(len(dataset)):
        text = torch.from_numpy(dataset[sample]["text"]).unsqueeze(0)  # [1, s + 1]
        found = find_bad_token([ids_only(text)], vocab_size=100)
        if 999 not in text:
            assert found is None
            continue
        _, row, position, token = found
        assert (row, token) == (0, 999)
        expected = TokenSource(str(tmp_path / "docs"), 2, 5)
        assert dataset.locate_token(sample, position) == blend.locate_token(sample, position) == expected


def test_bad_token_message_names_the_sample_the_rank_was_fed(tmp_path):
    """dp=2, mbs=2, 2 micro-batches per rank, the step after 8 consumed samples: rank 1's second micro-batch
    holds samples 14 and 15 (data/loader.sample_index); the bad id sits in sample 15 (document 2, token 6)."""
    docs = [list(range(10 + 20 * d, 25 + 20 * d)) for d in range(6)]
    docs[2][6] = 999
    dataset = _dataset(tmp_path, docs)
    assert 999 in dataset[15]["text"].tolist() and sum(999 in dataset[i]["text"] for i in range(len(dataset))) == 1
    messages = {}
    for dp_rank in range(2):
        data = build_data_iterator(dataset, 8, 2, dp_rank, 2, 0, -1, False, False, False, True)
        found = find_bad_token([next(data), next(data)], vocab_size=200)  # the documents' ids reach 124
        if found is not None:
            assert found[:2] == (1, 1)  # second micro-batch, second row
            messages[dp_rank] = bad_token_message(found, dataset, 8, 2, dp_rank, 2, 200, "train")
    assert list(messages) == [1]
    assert f"in document 2 of {tmp_path / 'docs'} (token 6 of the document, train sample 15)" in messages[1]


def test_last_label_and_negative_ids_are_checked():
    text = torch.tensor([[1, 2, 3, 4, 120]])
    assert find_bad_token([ids_only(text)], 100) == (0, 0, 4, 120)
    text = torch.tensor([[1, -3, 3]])
    assert find_bad_token([ids_only(text)], 100) == (0, 0, 1, -3)


# ---- non-finite values -----------------------------------------------------------------------------
def step(loss=1.0, grad_norm=1.0, skipped=False, loss_scale=1.0):
    return SimpleNamespace(loss=loss, grad_norm=grad_norm, skipped=skipped, loss_scale=loss_scale, moe={})


def test_nonfinite_guard_counts_consecutive_iterations():
    guard = NonFiniteGuard(3, min_loss_scale=1.0, dynamic_scale=False)
    guard.check(step(loss=math.nan), 1)
    guard.check(step(grad_norm=math.inf, skipped=True), 2)
    guard.check(step(), 3)  # a good iteration resets the count
    guard.check(step(loss=math.inf), 4)
    guard.check(step(loss=math.nan), 5)
    with pytest.raises(TrainingStopped, match=r"iterations 4-6 in a row \(3, train.max_nonfinite_iters=3\)"):
        guard.check(step(loss=math.nan), 6)


def test_fp16_skips_count_only_at_the_minimum_scale():
    guard = NonFiniteGuard(2, min_loss_scale=1.0, dynamic_scale=True)
    for i in range(10):  # the scale coming down from 2^32: ordinary
        guard.check(step(grad_norm=math.nan, skipped=True, loss_scale=2.0 ** (32 - i)), i + 1)
    guard.check(step(grad_norm=math.nan, skipped=True, loss_scale=1.0), 11)
    with pytest.raises(TrainingStopped, match="loss scale is stuck at its minimum"):
        guard.check(step(grad_norm=math.nan, skipped=True, loss_scale=1.0), 12)


# ---- metrics.jsonl --------------------------------------------------------------------------------
def test_metrics_nonfinite_values_are_null_with_a_flag(tmp_path):
    writer = MetricsWriter(str(tmp_path), True, tensorboard=False)
    writer.write({"iteration": 1, "lm_loss": math.nan, "grad_norm": math.inf, "lr": 0.1})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line) == {
        "iteration": 1,
        "lm_loss": None,
        "grad_norm": None,
        "lr": 0.1,
        "nonfinite": ["lm_loss", "grad_norm"],
    }


def test_torn_last_line_is_dropped_with_a_warning_naming_the_file(tmp_path):
    writer = MetricsWriter(str(tmp_path), True, tensorboard=False)
    for i in (1, 2, 3):
        writer.write({"iteration": i, "lm_loss": 1.0})
    with open(writer.path, "a") as handle:
        handle.write('{"iteration": 4, "lm_lo')
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger(LOGGER_NAME).addHandler(handler)
    try:
        writer.truncate_after(2)
    finally:
        logging.getLogger(LOGGER_NAME).removeHandler(handler)
    assert [json.loads(line)["iteration"] for line in open(writer.path)] == [1, 2]
    assert any(writer.path in r.getMessage() and "torn" in r.getMessage() for r in records)


def test_malformed_line_in_the_middle_names_file_and_line(tmp_path):
    writer = MetricsWriter(str(tmp_path), True, tensorboard=False)
    with open(writer.path, "w") as handle:
        handle.write('{"iteration": 1}\nnot json\n{"iteration": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: malformed JSON"):
        writer.truncate_after(2)


def test_fresh_start_sets_old_metrics_aside(tmp_path):
    writer = MetricsWriter(str(tmp_path), True, tensorboard=False)
    writer.write({"iteration": 1, "lm_loss": 1.0})
    assert writer.set_aside() == writer.path + ".1"
    assert not os.path.exists(writer.path) and writer.set_aside() is None


# ---- devices ----------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallbacks")
def test_cpu_is_refused_where_gpus_were_expected():
    with pytest.raises(ValueError, match=r"GPUs were expected \(CUDA_VISIBLE_DEVICES=0,1\).*train.device=cpu"):
        check_devices(TrainConfig(), {"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ValueError, match=r"GPUs were expected \(SLURM_GPUS_ON_NODE=4\)"):
        check_devices(TrainConfig(), {"SLURM_GPUS_ON_NODE": "4"})
    with pytest.raises(ValueError, match=r"GPUs were expected \(train.device=cuda\)"):
        check_devices(TrainConfig(device="cuda"), {})
    assert check_devices(TrainConfig(), {"SLURM_GPUS_ON_NODE": "0"}) is False
    assert check_devices(TrainConfig(device="cpu"), {"CUDA_VISIBLE_DEVICES": "0"}) is False


def test_more_local_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"4 ranks on this node but 2 visible GPU\(s\).*allow_gpu_sharing=true"):
        check_devices(TrainConfig(), {"LOCAL_WORLD_SIZE": "4"})
    assert check_devices(TrainConfig(allow_gpu_sharing=True), {"LOCAL_WORLD_SIZE": "4"}) is True
    assert check_devices(TrainConfig(), {"LOCAL_WORLD_SIZE": "2"}) is True


def test_an_interval_of_skipped_steps_reports_their_loss_not_zero():
    """fp16 skipping every step used to print "loss 0.0000": the loss of the skipped steps is reported."""
    from model.shape import IterationFlops
    from training.logging import IntervalStats

    stats = IntervalStats(IterationFlops(1.0, 1.0), 1, 1, "cpu")
    for loss in (6.0, 8.0):
        stats.add(step(loss=loss, grad_norm=math.nan, skipped=True, loss_scale=1.0), 0.1, 0.01)
    record = stats.flush(SimpleNamespace(iteration=2, consumed_samples=16, skipped_iters=2))
    assert record["lm_loss"] == 7.0 and record["skipped_iters"] == 2 and record["skipped_total"] == 2
