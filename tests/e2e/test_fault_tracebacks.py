"""Fault class "tracebacks instead of a message" (issue 24): sizes that cannot fit, odd blends, malformed
run.lock contents, a full disk at the metrics write, a tool's missing output folder, a start-up timeout too short
or a rank that never joins (issue 40). Each ends with one line and the documented exit code, or (a lock or
folder that can be recovered) runs on with a warning."""

from __future__ import annotations

import errno
import os
import time
import types

import pytest
import torch

import pretrain_gpt
from config.schema import load_config
from operations.guards import EXIT_ERROR, EXIT_HUNG, EXIT_INPUT_ERROR
from operations.run_lock import LOCK_NAME
from parallel.layout import layout_from_config
from tests.conftest import read_metrics
from tests.e2e.faults import QUICK, one_error_line, run_main, run_trainer_ranks
from tools import merge_datasets, pipeline_timeline
from training.logging import MetricsWriteError, MetricsWriter
from training.size_check import check_fits

pytestmark = pytest.mark.tier("fast")


@pytest.mark.parametrize(
    "overrides",
    [
        ("model.hidden_size=1073741824",),
        ("model.seq_length=1000000000",),
        ("train.micro_batch_size=1000000", "train.global_batch_size=1000000"),
        ("model.num_layers=10000000",),
        ("model.num_layers=64", "model.hidden_size=16384", "model.num_attention_heads=128"),
    ],
    ids=["hidden-2^30", "seq-10^9", "micro-batch-10^6", "layers-10^7", "a-large-model"],
)
def test_sizes_that_cannot_fit_are_refused_before_any_allocation(tiny_corpus, tmp_path, capsys, overrides):
    run_dir = str(tmp_path / "run")
    assert run_main(tiny_corpus, run_dir, *QUICK, *overrides) == EXIT_INPUT_ERROR
    line = one_error_line(capsys)
    assert "this run cannot fit: the planner estimates at least" in line and "GiB" in line, line
    assert not os.path.exists(run_dir)  # nothing built, nothing written


@pytest.mark.parametrize(
    "blend,expected",
    [
        ("[0,{p},1,{p}]", "weight 0 of"),
        ("[-1,{p},2,{p}]", "weight -1 of"),
        ("[0.5,{p},{p}]", "has 3 entries with weights among them"),
        ("[0.5,{p},{p},0.5]", "stands where a weight is expected"),
        ("[{p},0.5,{p},0.5]", "stands where a weight is expected"),
    ],
    ids=["zero-weight", "negative-weight", "odd-list", "weight-last", "prefix-first"],
)
def test_bad_blend_lists_name_data_path(tiny_corpus, tmp_path, capsys, blend, expected):
    data_path = blend.format(p=tiny_corpus["data_prefix"])
    assert run_main(tiny_corpus, str(tmp_path / "run"), *QUICK, f"data.data_path={data_path}") == EXIT_INPUT_ERROR
    line = one_error_line(capsys)
    assert "data.data_path" in line and expected in line, line


@pytest.mark.parametrize(
    "contents", [b"[1, 2]", b'{"pid": "abc", "host": "x"}', b"\x00\x01garbage", b'"a string"', b"{}"]
)
def test_malformed_run_lock_is_replaced_with_a_warning(tiny_corpus, tmp_path, capsys, contents):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_NAME).write_bytes(contents)
    assert run_main(tiny_corpus, str(run_dir), *QUICK) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"replaced the unreadable lock file {run_dir / LOCK_NAME}" in err, err
    assert not (run_dir / LOCK_NAME).exists() and len(read_metrics(str(run_dir))) == 2


def _metrics_disk_full(monkeypatch, metrics_path_end: str = "metrics.jsonl"):
    real_open = os.open

    def full_open(path, flags, *args):
        if str(path).endswith(metrics_path_end) and flags & os.O_APPEND:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", full_open)


def test_full_disk_at_the_first_metrics_write_is_one_line(tiny_corpus, tmp_path, capsys, monkeypatch):
    run_dir = str(tmp_path / "run")
    _metrics_disk_full(monkeypatch)
    assert run_main(tiny_corpus, run_dir, *QUICK) == EXIT_ERROR
    line = one_error_line(capsys)
    assert os.path.join(run_dir, "metrics.jsonl") in line and "no space left on device" in line, line
    assert "at iteration 0" in line  # the first write: the start record (iteration 0, the thread choice)


@pytest.mark.parametrize("written", [0, 5])
def test_metrics_short_write_on_a_full_disk_names_it(tmp_path, monkeypatch, written):
    writer = MetricsWriter(str(tmp_path), enabled=True, tensorboard=False)
    monkeypatch.setattr(os, "write", lambda fd, data: written)
    monkeypatch.setattr("checkpoint.write_errors.free_disk_bytes", lambda folder: 0)
    with pytest.raises(MetricsWriteError, match="no space left on device .*short write"):
        writer.write({"iteration": 3, "lm_loss": 1.0})


@pytest.mark.parametrize("tool", ["merge_datasets", "pipeline_timeline"])
def test_a_tools_missing_output_folder_is_created(tiny_corpus, tmp_path, tool):
    out = tmp_path / "not" / "there"
    if tool == "merge_datasets":
        merge_datasets.main(["--input", tiny_corpus["data_prefix"], "--output-prefix", str(out / "merged")])
        assert (out / "merged.bin").exists() and (out / "merged.idx").exists()
    else:
        assert pipeline_timeline.main(["--pp", "2", "--microbatches", "4", "--output", str(out / "t.png")]) == 0
        assert (out / "t.png").exists()


def test_a_tools_output_under_a_file_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code = pipeline_timeline.main(["--pp", "2", "--microbatches", "4", "--output", str(blocker / "t.png")])
    assert code == 2
    line = one_error_line(capsys)
    assert str(blocker / "t.png") in line


def test_size_check_uses_the_gpus_memory_under_cuda(monkeypatch):
    """Without a GPU here: the CUDA branch reads the device's total memory (one rank per GPU)."""
    gpu = types.SimpleNamespace(name="NVIDIA H200", total_memory=141 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: gpu)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    fits = load_config(pretrain_gpt.DEFAULT_CONFIG, ["model.vocab_size=50304"])
    check_fits(fits, layout_from_config(fits, 1), True, {"LOCAL_RANK": "0"})  # the tiny model fits
    gpt3 = ["model.num_layers=96", "model.hidden_size=12288", "model.num_attention_heads=96"]
    big = load_config(pretrain_gpt.DEFAULT_CONFIG, gpt3)
    with pytest.raises(ValueError, match=r"one rank has 141.0 GiB \(the NVIDIA H200's 141.0 GiB\)"):
        check_fits(big, layout_from_config(big, 1), True, {"LOCAL_RANK": "0"})


def _error_lines(capfd) -> list[str]:
    """The `error:` lines the ranks wrote to stderr, after checking that no Python traceback came with them."""
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_a_sub_second_init_timeout_is_refused_on_every_rank(tiny_corpus, tmp_path, capfd):
    run_dir = str(tmp_path / "run")
    codes = run_trainer_ranks(tiny_corpus, run_dir, 2, [0, 1], *QUICK, "parallel.init_timeout_s=0.01")
    assert codes == [EXIT_INPUT_ERROR, EXIT_INPUT_ERROR]
    expected = "error: parallel.init_timeout_s=0.01 must be in [1, 604800] (every rank joins the process groups"
    lines = _error_lines(capfd)
    assert len(lines) == 2 and all(line.startswith(expected) for line in lines), lines
    assert not os.path.exists(run_dir)


@pytest.mark.parametrize("rank", [0, 1], ids=["store-host-alone", "rank-1-alone"])
def test_a_rank_that_never_joins_ends_start_up_in_one_line(tiny_corpus, tmp_path, capfd, rank):
    """The other rank of two never starts: the one that did waits parallel.init_timeout_s at the rendezvous
    (rank 0 for its peer's key, rank 1 to reach rank 0's store), then exits 5 like any start-up timeout."""
    run_dir = str(tmp_path / "run")
    started = time.monotonic()
    assert run_trainer_ranks(tiny_corpus, run_dir, 2, [rank], *QUICK, "parallel.init_timeout_s=1") == [EXIT_HUNG]
    lines = _error_lines(capfd)
    expected = f"error: rank {rank}: creating the world process group (2 ranks, gloo) timed out after "
    assert len(lines) == 1 and lines[0].startswith(expected), lines
    assert "(parallel.init_timeout_s=1): not every rank joined within it" in lines[0], lines[0]
    assert time.monotonic() - started < 60.0  # the 1 s bound, not torch's 30 minutes
    assert not os.path.exists(run_dir)
