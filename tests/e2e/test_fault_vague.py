"""Fault class "vague" (issue 24): a full disk during a save says "no space left on device", a second Ctrl-C
exits 130 wherever it lands (DCP wraps it), a refused resume never advises what was given, and errors about
run.dir, the config file, checkpoint.load and the blend list name the key or file."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from checkpoint import files, saver
from operations.guards import EXIT_ERROR, EXIT_INPUT_ERROR, EXIT_INTERRUPTED
from tests.e2e.faults import QUICK, one_error_line, run_main

pytestmark = pytest.mark.tier("fast")


def _dcp_fails_with(error: BaseException):
    """A dcp.save / dcp.load that fails as DCP does: the rank's exception wrapped in a CheckpointException."""

    def fail(*args, **kwargs):
        try:
            raise error
        except BaseException as err:
            raise CheckpointException("failed", {0: _wrap_exception(err)}) from None

    return fail


@pytest.mark.parametrize("where", ["tensors-unexpected-pos", "tensors-enospc", "rng-unexpected-pos"])
def test_full_disk_during_a_save_says_no_space_left(tiny_corpus, tmp_path, capsys, monkeypatch, where):
    run_dir = str(tmp_path / "run")
    if where == "tensors-unexpected-pos":  # torch's zip writer on a full disk; the disk is then (nearly) full
        monkeypatch.setattr(dcp, "save", _dcp_fails_with(RuntimeError("unexpected pos 704 vs 598")))
        monkeypatch.setattr("checkpoint.write_errors.free_disk_bytes", lambda folder: 4096)
    elif where == "tensors-enospc":
        monkeypatch.setattr(dcp, "save", _dcp_fails_with(OSError(28, os.strerror(28), "x.distcp")))
    else:

        def torn_save(obj, path, *args, **kwargs):  # what torch.save raises when the disk fills mid-file
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 10 vs 4")

        monkeypatch.setattr(saver.torch, "save", torn_save)
        monkeypatch.setattr("checkpoint.write_errors.free_disk_bytes", lambda folder: 0)
    assert run_main(tiny_corpus, run_dir, *QUICK) == EXIT_ERROR
    line = one_error_line(capsys)
    assert "checkpoint save at iteration 2 failed" in line and "no space left on device" in line, line
    root = os.path.join(run_dir, "checkpoints")
    assert files.read_tracker(root) is None and not any(".tmp." in n for n in os.listdir(root))


def test_full_disk_on_a_real_tmpfs(tiny_corpus, tmp_path, capsys):
    """run.dir on a 384 KiB tmpfs: the config and metrics fit, the checkpoint (~1 MiB) does not."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=384k", "tmpfs", str(mount)], check=False).returncode:
        pytest.skip("mount -t tmpfs is not allowed here")
    try:
        assert run_main(tiny_corpus, str(mount / "run"), *QUICK) == EXIT_ERROR
        line = one_error_line(capsys)
        assert "no space left on device" in line, line
        root = mount / "run" / "checkpoints"
        assert not any(".tmp." in n for n in os.listdir(root))  # the partial save is gone, the space freed
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("during", ["save", "load"])
def test_a_second_sigint_wrapped_by_dcp_exits_130(tiny_corpus, tmp_path, capsys, monkeypatch, during):
    run_dir = str(tmp_path / "run")
    if during == "load":
        assert run_main(tiny_corpus, run_dir, *QUICK) == 0
        capsys.readouterr()

    def two_sigints(*args, **kwargs):  # both arrive inside DCP, whose wrapper turns them into its exception
        try:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException as err:
            raise CheckpointException("failed", {0: _wrap_exception(err)}) from None

    if during == "save":
        monkeypatch.setattr(dcp, "save", two_sigints)
        extra = QUICK
    else:
        monkeypatch.setattr(dcp, "load", two_sigints)
        extra = ("train.train_iters=4", "train.eval_iters=0", "optim.lr_warmup_iters=0", "checkpoint.load=true")
    assert run_main(tiny_corpus, run_dir, *extra) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "stopped at once" in err and "CheckpointException" not in err and "Traceback" not in err, err
    root = os.path.join(run_dir, "checkpoints")
    assert files.read_tracker(root) == (None if during == "save" else 2)
    assert not any(".tmp." in n for n in os.listdir(root)) and not os.path.exists(os.path.join(run_dir, "run.lock"))


@pytest.fixture(scope="module")
def finished_run(tiny_corpus, tmp_path_factory) -> str:
    run_dir = str(tmp_path_factory.mktemp("finished") / "run")
    args = ("train.train_iters=4", "train.eval_iters=0", "optim.lr_warmup_iters=0", "checkpoint.save_interval=2")
    assert run_main(tiny_corpus, run_dir, *args) == 0
    return run_dir


@pytest.mark.parametrize("how", ["finetune-true", "load-older-iteration", "load-true-newest-broken"])
def test_a_refused_resume_never_advises_what_was_given(tiny_corpus, finished_run, tmp_path, capsys, how):
    run_dir = shutil.copytree(finished_run, str(tmp_path / "run"))
    root = os.path.join(run_dir, "checkpoints")
    args = ["train.train_iters=6", "train.eval_iters=0", "optim.lr_warmup_iters=0"]
    if how == "finetune-true":
        args += ["checkpoint.load=true", "checkpoint.finetune=true"]
    elif how == "load-older-iteration":
        args += [f"checkpoint.load={os.path.join(root, 'iter_0000002')}"]
    else:
        os.remove(os.path.join(root, files.TRACKER))
        os.remove(os.path.join(root, "iter_0000004", files.META))
        args += ["checkpoint.load=true"]
    assert run_main(tiny_corpus, run_dir, *args) == EXIT_INPUT_ERROR
    line = one_error_line(capsys)
    assert "iter_0000004" in line and "another run.dir" in line, line
    assert "with checkpoint.load=true" not in line, line


def test_errors_name_the_key_or_file(tiny_corpus, tmp_path, capsys):
    binary = tmp_path / "config.yaml"
    binary.write_bytes(b"\x7fELF\x00\x01\x02" * 10)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"train:\n  seed: \xff\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        ((f"run.dir={a_file}",), None, f"run.dir={a_file} cannot hold the run"),
        (("run.dir=",), None, "run.dir is given no value"),
        (("checkpoint.load=",), None, "checkpoint.load is given no value: give it a bool or str"),
        ((), str(binary), f"config file {binary} is a binary file"),
        ((), str(latin), f"config file {latin} is not UTF-8 text"),
        (("data.data_path=[0.5,a,b]",), None, "data.data_path="),
        (("data.split=1.2.3,1",), None, "data.split='1.2.3,1'"),
    ]
    for overrides, config, expected in cases:
        code = run_main(tiny_corpus, str(tmp_path / "run"), *QUICK, *overrides, config=config)
        line = one_error_line(capsys)
        assert code == EXIT_INPUT_ERROR and expected in line, (expected, line)
