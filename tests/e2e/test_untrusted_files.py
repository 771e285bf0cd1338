"""Every file a user hands us is read through one safe path: a crafted pickle in a checkpoint (DCP's `.metadata`,
rng/*.pt, a format-1 file, a transformers pytorch_model.bin) runs nothing through any entry point: the trainer
(resume, fine-tune), tools/checkpoint_info.py (with and without --verify), every converter that reads one
(to-hf, to-megatron, consolidate, from-hf) and tools/generate.py. Each exits 2 with one line naming the file.
Checksums are no defence (whoever crafts the file can rewrite checksums.json): every case is tried with
checksums that match, and the checkpoint cases also with checksums that do not (the file is refused either
way, before any checksum verdict could be bypassed). Megatron-LM's files: tests/tools/test_convert_megatron.py.
"""

from __future__ import annotations

import os
import shutil

import pytest

import pretrain_gpt
from tests.conftest import tiny_train_args
from tests.payloads import (
    PAYLOAD_GLOBAL,
    arm_dcp_metadata,
    arm_torch_file,
    assert_refused,
    match_checksums,
)
from tools import checkpoint_info, convert_checkpoint, generate

pytestmark = pytest.mark.tier("fast")

ITERATION = "iter_0000002"


@pytest.fixture(scope="module")
def trained(tiny_corpus, tmp_path_factory) -> str:
    """A one-process run of 2 iterations with its checkpoint (weights, optimizer, rng); returns run.dir."""
    run_dir = str(tmp_path_factory.mktemp("trained") / "run")
    argv = tiny_train_args(
        tiny_corpus, run_dir, "train.train_iters=2", "train.eval_iters=0", "checkpoint.save_interval=2"
    )
    assert pretrain_gpt.main(["--config", pretrain_gpt.DEFAULT_CONFIG, *argv]) == 0
    return run_dir


@pytest.fixture(scope="module")
def hf_folder(trained, tmp_path_factory) -> str:
    """The trained checkpoint exported to transformers, its weights as a pytorch_model.bin."""
    import torch
    from safetensors.torch import load_file

    out = str(tmp_path_factory.mktemp("hf") / "model")
    convert_checkpoint.to_hf(os.path.join(trained, "checkpoints"), out)
    safetensors = os.path.join(out, "model.safetensors")
    torch.save(load_file(safetensors), os.path.join(out, "pytorch_model.bin"))
    os.remove(safetensors)
    return out


def _copy_run(trained: str, tmp_path) -> tuple[str, str]:
    """A copy of the trained run's checkpoints; returns (checkpoints folder, iteration folder)."""
    root = str(tmp_path / "checkpoints")
    shutil.copytree(os.path.join(trained, "checkpoints"), root)
    return root, os.path.join(root, ITERATION)


def _armed_metadata(trained: str, tmp_path, marker: str, checksums_match: bool) -> tuple[str, str]:
    root, iter_dir = _copy_run(trained, tmp_path)
    bad = arm_dcp_metadata(iter_dir, marker)
    if checksums_match:
        match_checksums(iter_dir)
    return root, bad


def _train(tiny_corpus, tmp_path, *extra: str) -> int:
    argv = tiny_train_args(tiny_corpus, str(tmp_path / "run"), "train.train_iters=4", "train.eval_iters=0", *extra)
    return pretrain_gpt.main(["--config", pretrain_gpt.DEFAULT_CONFIG, *argv])


CHECKSUMS = pytest.mark.parametrize("checksums_match", [True, False], ids=["checksums-match", "checksums-stale"])


@CHECKSUMS
@pytest.mark.parametrize("verify", [False, True], ids=["info", "verify"])
def test_checkpoint_info(trained, tmp_path, capsys, marker, checksums_match, verify):
    root, bad = _armed_metadata(trained, tmp_path, marker, checksums_match)
    code = checkpoint_info.main([root, *(["--verify"] if verify else [])])
    err = capsys.readouterr().err
    assert_refused(code, err, bad, marker)
    assert f"pickles {PAYLOAD_GLOBAL}" in err  # the allow-list refuses it whatever checksums.json says


@CHECKSUMS
@pytest.mark.parametrize("how", ["load", "finetune"])
def test_trainer_resume_and_finetune(trained, tiny_corpus, tmp_path, capsys, marker, checksums_match, how):
    root, bad = _armed_metadata(trained, tmp_path, marker, checksums_match)
    code = _train(tiny_corpus, tmp_path, f"checkpoint.{how}={root}")
    err = capsys.readouterr().err
    assert_refused(code, err, bad, marker)
    if checksums_match:  # else the file is refused for failing its checksum (torn or tampered), named too
        assert f"pickles {PAYLOAD_GLOBAL}" in err
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


@pytest.mark.parametrize("command", ["to-hf", "to-megatron", "consolidate"])
def test_converters(trained, tmp_path, capsys, marker, command):
    root, bad = _armed_metadata(trained, tmp_path, marker, checksums_match=True)
    out = str(tmp_path / ("out.pt" if command == "consolidate" else "out"))
    code = convert_checkpoint.main([command, root, out])
    err = capsys.readouterr().err
    assert_refused(code, err, bad, marker)
    assert f"pickles {PAYLOAD_GLOBAL}" in err and not os.path.exists(out)


def test_generate_from_a_checkpoint(trained, tmp_path, capsys, marker):
    root, bad = _armed_metadata(trained, tmp_path, marker, checksums_match=True)
    code = generate.main(["--checkpoint", root, "--prompt", "a", "--max-new-tokens", "2"])
    assert_refused(code, capsys.readouterr().err, bad, marker)


@pytest.mark.parametrize("entry", ["from-hf", "generate"])
def test_a_pickled_transformers_folder(hf_folder, tmp_path, capsys, marker, entry):
    folder = str(tmp_path / "hf")
    shutil.copytree(hf_folder, folder)
    bad = arm_torch_file(os.path.join(folder, "pytorch_model.bin"), marker)
    if entry == "from-hf":
        code = convert_checkpoint.main(["from-hf", folder, str(tmp_path / "out")])
        assert not os.path.exists(tmp_path / "out")
    else:
        code = generate.main(["--checkpoint", folder, "--prompt", "a", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert_refused(code, err, bad, marker)
    assert f"pickles {PAYLOAD_GLOBAL}" in err


def test_trainer_rng_file(trained, tiny_corpus, tmp_path, capsys, marker):
    """rng/rank_00000.pt is read on a resume at the saved layout."""
    root, iter_dir = _copy_run(trained, tmp_path)
    bad = arm_torch_file(os.path.join(iter_dir, "rng", "rank_00000.pt"), marker)
    match_checksums(iter_dir)
    code = _train(tiny_corpus, tmp_path, f"checkpoint.load={root}")
    err = capsys.readouterr().err
    assert_refused(code, err, bad, marker)
    assert f"pickles {PAYLOAD_GLOBAL}" in err


def test_trainer_format1_file(tiny_corpus, tmp_path, capsys, marker):
    """The per-rank format of earlier versions (mp_rank_00_000/model_optim_rng.pt, no meta.json)."""
    root = tmp_path / "checkpoints"
    os.makedirs(root / ITERATION / "mp_rank_00_000")
    bad = arm_torch_file(str(root / ITERATION / "mp_rank_00_000" / "model_optim_rng.pt"), marker)
    (root / "latest_checkpointed_iteration.txt").write_text("2\n")
    code = _train(tiny_corpus, tmp_path, f"checkpoint.load={root}")
    assert_refused(code, capsys.readouterr().err, bad, marker)
