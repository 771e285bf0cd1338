"""Damaged Megatron-LM checkpoints and our own, through the converters and tools/checkpoint_info.py (issue 31's
campaign, each case reproduced first): ONE line naming the file, exit status 2, nothing written.

- legacy torch format: a truncated or empty .pt, a short weight, a junk tracker, an extra or a missing
  mp_rank folder, a missing rank file;
- torch_dist (written by megatron-core's dist_checkpointing): a missing shard, a truncated .distcp, a flipped
  byte anywhere in .metadata, damaged metadata.json and common.pt;
- ours: a junk tracker, meta.json or checksums.json of null; checkpoint_info shows a cp2 checkpoint's cp."""

import os
import shutil

import pytest
import torch

from checkpoint import save_model_weights
from model.config import ModelConfig
from parallel.model_builder import build_model_chunks
from parallel.state import ParallelState
from tests.conftest import run_ranks
from tests.tools import test_convert_checkpoint as base
from tests.tools.converter_inputs import (
    TRACKER,
    copy,
    cut,
    refused,
    write_bytes,
)
from tools import checkpoint_info

pytestmark = pytest.mark.tier("fast")


@pytest.fixture(scope="module")
def torch_dist(tmp_path_factory):
    """A torch_dist checkpoint written by megatron-core's dist_checkpointing at tp 2 (two .distcp shards)."""
    from tests.tools.megatron_runs import megatron_ranks

    out = tmp_path_factory.mktemp("torch_dist")
    job = dict(style="gpt", tp=2, pp=1, vp=1, logits=str(out / "logits.pt"), torch_dist=str(out / "dist"))
    run_ranks(2, megatron_ranks, [job])
    return str(out / "dist")


# ---- from-megatron ---------------------------------------------------------------------------------
RANK0 = os.path.join("iter_0000003", "mp_rank_00", "model_optim_rng.pt")


def _short_weight(root: str) -> None:
    """Layer 1's fc1 shard on tp rank 0 three rows short."""
    payload = torch.load(os.path.join(root, RANK0), weights_only=False)
    model = payload["model"]
    model["decoder.layers.1.mlp.linear_fc1.weight"] = model["decoder.layers.1.mlp.linear_fc1.weight"][:-3]
    torch.save(payload, os.path.join(root, RANK0))


DAMAGED_LEGACY = {
    "half-length": (
        lambda root: cut(os.path.join(root, RANK0)),
        "{root}/{rank0} cannot be read (PytorchStreamReader failed",
    ),
    "empty": (
        lambda root: write_bytes(os.path.join(root, RANK0), b""),
        "{root}/{rank0} cannot be read (Expected input to be",
    ),
    "short-weight": (
        _short_weight,
        "{root}/{rank0}: tensor layers.1.mlp.fc1.weight is [125, 64] but the model its args describe holds "
        "[128, 64] on tp rank 0 of 2: the file is damaged or its args are not its own",
    ),
    "binary-tracker": (
        lambda root: write_bytes(os.path.join(root, TRACKER), b"\xff\xfe\x00junk"),
        "{root}/latest_checkpointed_iteration.txt cannot be read as text (UnicodeDecodeError): not a Megatron",
    ),
    "junk-tracker": (
        lambda root: write_bytes(os.path.join(root, TRACKER), b"junk"),
        "{root}/latest_checkpointed_iteration.txt holds",
    ),
    "extra-mp-rank": (
        lambda root: shutil.copytree(*(os.path.join(root, "iter_0000003", f"mp_rank_0{r}") for r in (1, 3))),
        "{root}/iter_0000003/mp_rank_03 is unexpected: the args say tp=2 x pp=1; move it out of",
    ),
    "missing-mp-rank": (
        lambda root: shutil.rmtree(os.path.join(root, "iter_0000003", "mp_rank_01")),
        "{root}/iter_0000003 misses mp_rank_01 (1 of the 2 mp_rank folders of tp=2 x pp=1 missing)",
    ),
    "missing-rank-file": (
        lambda root: os.remove(os.path.join(root, "iter_0000003", "mp_rank_01", "model_optim_rng.pt")),
        "{root}/iter_0000003/mp_rank_01/model_optim_rng.pt is missing: the checkpoint is incomplete",
    ),
}


@pytest.mark.parametrize("damage,expected", list(DAMAGED_LEGACY.values()), ids=list(DAMAGED_LEGACY))
def test_a_damaged_megatron_checkpoint_is_one_line(converter_sources, tmp_path, capsys, damage, expected):
    root = copy(converter_sources["megatron"], tmp_path)
    damage(root)
    message = refused(capsys, "from-megatron", root, str(tmp_path / "out"))
    assert message.startswith(expected.format(root=root, rank0=RANK0)), message


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


DAMAGED_TORCH_DIST = {
    "missing-shard": (
        lambda it: os.remove(os.path.join(it, "__1_0.distcp")),
        "checkpoint file {it}/__1_0.distcp (holding ",
    ),
    "truncated-distcp": (
        lambda it: cut(os.path.join(it, "__0_1.distcp")),
        "checkpoint file {it}/__0_1.distcp is too short for ",
    ),
    "null-metadata-json": (
        lambda it: write_bytes(os.path.join(it, "metadata.json"), b"null"),
        "{it}/metadata.json is not dist_checkpoint",
    ),
    "truncated-metadata": (lambda it: cut(os.path.join(it, ".metadata")), "{it}/.metadata cannot be read"),
    "no-metadata": (lambda it: os.remove(os.path.join(it, ".metadata")), "{it}/.metadata is missing"),
    "half-common": (
        lambda it: cut(os.path.join(it, "common.pt")),
        "{it}/common.pt cannot be read (PytorchStreamReader",
    ),
}


@pytest.mark.parametrize("damage,expected", list(DAMAGED_TORCH_DIST.values()), ids=list(DAMAGED_TORCH_DIST))
def test_a_damaged_torch_dist_checkpoint_is_one_line(torch_dist, tmp_path, capsys, damage, expected):
    root = copy(torch_dist, tmp_path)
    iter_dir = os.path.join(root, "iter_0000007")
    damage(iter_dir)
    message = refused(capsys, "from-megatron", root, str(tmp_path / "out"))
    assert message.startswith(expected.format(it=iter_dir)), message


def test_a_flipped_byte_in_torch_dist_metadata_names_it_or_changes_nothing(torch_dist, tmp_path, capsys):
    """A byte flipped anywhere in .metadata (opcodes, string lengths, text, chunk offsets and sizes, storage
    extents): one line naming .metadata (the chunks and extents are checked before DCP reads), or, for a byte no
    model tensor depends on (optimizer and RNG entries), the same tensors; never other weights silently."""
    from convert.megatron import load_megatron_checkpoint

    root = copy(torch_dist, tmp_path)
    metadata = os.path.join(root, "iter_0000007", ".metadata")
    original = open(metadata, "rb").read()
    _, reference, _ = load_megatron_checkpoint(root)
    refusals = 0
    for offset in range(3, len(original), len(original) // 200):
        _flip(metadata, offset)
        try:
            _, tensors, _ = load_megatron_checkpoint(root)
        except ValueError as err:
            assert metadata in str(err) and "\n" not in str(err), (offset, str(err))
            refusals += 1
        else:
            assert all(torch.equal(tensors[k], reference[k]) for k in reference), offset
        write_bytes(metadata, original)
    assert refusals > 100  # most bytes matter
    _flip(metadata, 2)  # the pickle's first frame opcode, through the command line
    assert refused(capsys, "from-megatron", root, str(tmp_path / "out")).startswith(f"{metadata} cannot be read")


# ---- our checkpoints and checkpoint_info.py --------------------------------------------------------
@pytest.mark.parametrize("command", ["to-hf", "to-megatron", "consolidate"])
def test_a_junk_tracker_of_our_checkpoint_is_one_line(converter_sources, tmp_path, capsys, command):
    root = copy(converter_sources["ours"], tmp_path)
    write_bytes(os.path.join(root, TRACKER), b"\xff\xfejunk")
    assert refused(capsys, command, root, str(tmp_path / "out")) == (
        f"checkpoint tracker {root}/{TRACKER} is not text, not an iteration number: delete it (the newest complete "
        "iter_* folder is found without it) or write the iteration into it"
    )
    assert checkpoint_info.main([root]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: checkpoint tracker {root}/{TRACKER} is not text, not an iteration number: delete it (the newest complete iter_* folder is found without it) or write the iteration into it"
    ]


@pytest.mark.parametrize("name", ["meta.json", "checksums.json"])
def test_a_null_json_file_of_our_checkpoint_is_one_line(converter_sources, tmp_path, capsys, name):
    root = copy(converter_sources["ours"], tmp_path)
    path = os.path.join(root, "iter_0000003", name)
    write_bytes(path, b"null")
    assert refused(capsys, "to-hf", root, str(tmp_path / "out")).startswith(f"checkpoint file {path} is corrupt")
    assert checkpoint_info.main([root]) == 2
    assert capsys.readouterr().err.startswith(f"error: checkpoint file {path} is corrupt")


def test_checkpoint_info_names_a_megatron_checkpoint(converter_sources, capsys):
    """Megatron-LM's mp_rank folders are not this project's format 1 (which writes dp_rank files beside them)."""
    iter_dir = os.path.join(converter_sources["megatron"], "iter_0000003")
    assert checkpoint_info.main([iter_dir]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {iter_dir} is not a checkpoint of this project: mp_rank folders without dp_rank files are "
        "Megatron-LM's; convert it with tools/convert_checkpoint.py from-megatron"
    ]


def _save_cp2(rank, world_size, config, root):
    state = ParallelState.create(1, 1, cp_size=2)
    chunks = build_model_chunks(ModelConfig(**config["model"]), state, 0, torch.device("cpu"), torch.float32)
    save_model_weights(root, 2, chunks, state, config)


def test_checkpoint_info_shows_context_parallelism(tokenizer_files, tmp_path, capsys):
    config = base.run_config(dict(base.GPT, num_layers=2), tokenizer_files)
    run_ranks(2, _save_cp2, config, str(tmp_path / "ckpt"))
    assert checkpoint_info.main([str(tmp_path / "ckpt")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  saved at tp 1 x cp 2 x pp 1 x vp 1 x dp 1 (world 2)" in lines
