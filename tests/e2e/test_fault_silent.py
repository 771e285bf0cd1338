"""Fault class "silent wrong results" (issue 24): input that used to train, load or convert to a wrong result
with exit 0 is refused with one line naming the file (and line, key, tensor or token) and exit 2 (1 for a
checkpoint that does not verify)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from checkpoint import files
from checkpoint.safe_reader import read_metadata_file
from operations.guards import EXIT_INPUT_ERROR
from tests.e2e.faults import QUICK, copy_corpus, copy_tree, one_error_line, run_main
from tests.payloads import match_checksums
from tools import checkpoint_info, convert_checkpoint, generate

pytestmark = pytest.mark.tier("fast")


def _longer_bin(prefix: str) -> None:
    with open(prefix + ".bin", "ab") as handle:  # another dataset's tokens appended
        handle.write(b"\x01\x00\x00\x00" * 100)


def _yaml_file(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    return path


@pytest.mark.parametrize(
    "case", ["all-negative-ids", "some-negative-ids", "bin-longer-than-idx", "yaml-key-twice", "yaml-section-twice"]
)
def test_wrong_input_is_refused_with_one_line(tiny_corpus, tmp_path, capsys, case):
    run_dir, extra, config = str(tmp_path / "run"), list(QUICK), None
    if case.endswith("negative-ids"):
        every = 1 if case.startswith("all") else 53

        def negate(tokens):
            tokens[every // 2 :: every] = -5
            return tokens

        extra.append(f"data.data_path=[{copy_corpus(tiny_corpus, str(tmp_path), negate)}]")
        expected = ["token id -5 in document", "model.vocab_size"]
    elif case == "bin-longer-than-idx":
        prefix = copy_corpus(tiny_corpus, str(tmp_path))
        _longer_bin(prefix)
        extra.append(f"data.data_path=[{prefix}]")
        expected = [prefix + ".bin", "does not belong to this .idx"]
    elif case == "yaml-key-twice":
        config = _yaml_file(str(tmp_path / "c.yaml"), "train:\n  train_iters: 5\n  seed: 1\n  train_iters: 7\n")
        expected = [config, "duplicate key 'train_iters' on line 4 (first on line 2)"]
    else:
        config = _yaml_file(str(tmp_path / "c.yaml"), "train:\n  seed: 1\nmodel:\n  num_layers: 2\ntrain:\n  seed: 2\n")
        expected = [config, "duplicate key 'train' on line 5 (first on line 1)"]
    assert run_main(tiny_corpus, run_dir, *extra, config=config) == EXIT_INPUT_ERROR
    line = one_error_line(capsys)
    assert all(text in line for text in expected), line
    assert not os.path.exists(os.path.join(run_dir, "checkpoints"))


@pytest.fixture(scope="module")
def two_checkpoints(tiny_corpus, tmp_path_factory) -> str:
    """A run with checkpoints at iterations 2 and 4; returns its checkpoints folder."""
    run_dir = str(tmp_path_factory.mktemp("two") / "run")
    args = ("train.train_iters=4", "train.eval_iters=0", "optim.lr_warmup_iters=0", "checkpoint.save_interval=2")
    assert run_main(tiny_corpus, run_dir, *args) == 0
    return os.path.join(run_dir, "checkpoints")


def _flip_byte(path: str) -> None:
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x10
    open(path, "wb").write(bytes(raw))


DAMAGE = {
    "checksums-garbage": lambda d: open(os.path.join(d, files.CHECKSUMS), "w").write("garbage"),
    "meta-missing": lambda d: os.remove(os.path.join(d, files.META)),
    "tensor-file-truncated": lambda d: open(os.path.join(d, "__0_0.distcp"), "r+b").truncate(100),
    "tensor-byte-flipped": lambda d: _flip_byte(os.path.join(d, "__0_0.distcp")),
}


@pytest.mark.parametrize("trackers", ["trackers-gone", "trackers-kept"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_checkpoint_info_verify_names_a_broken_newest_checkpoint(two_checkpoints, tmp_path, capsys, damage, trackers):
    root = copy_tree(two_checkpoints, str(tmp_path / "checkpoints"))
    newest = os.path.join(root, "iter_0000004")
    DAMAGE[damage](newest)
    if trackers == "trackers-gone":
        os.remove(os.path.join(root, files.TRACKER))
        os.remove(os.path.join(root, files.ALIAS))
    code = checkpoint_info.main([root, "--verify"])
    err = capsys.readouterr().err
    assert code in (1, 2) and newest in err and "verify: OK" not in err, err
    if trackers == "trackers-gone":  # the older checkpoint is shown, the broken newest one is named
        assert code == 1 and "a resume loads iter_0000002" in err
    assert checkpoint_info.main([two_checkpoints, "--verify"]) == 0  # the undamaged folder still verifies


CRAFTED_KEY = "layers.0.mlp.fc1.weight"


def _craft_metadata(iter_dir: str, entry: str) -> None:
    """Rewrite CRAFTED_KEY's entry of iter_dir's DCP index (checksums rewritten to match, as a crafter would):
    `bytes` a blob, `huge` a [10**12] tensor stored in 128 bytes, `extent` its chunk placed at byte 2**62."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex

    path = os.path.join(iter_dir, files.DCP_METADATA)
    metadata = read_metadata_file(path)
    [index] = [i for i in metadata.storage_data if i.fqn == CRAFTED_KEY]
    info = metadata.storage_data.pop(index)
    if entry == "bytes":
        metadata.state_dict_metadata[CRAFTED_KEY] = BytesStorageMetadata()
        index = MetadataIndex(CRAFTED_KEY)
    elif entry == "huge":
        tensor = metadata.state_dict_metadata[CRAFTED_KEY]
        tensor.size = torch.Size([10**12])  # type: ignore[union-attr]
        tensor.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([10**12]))]  # type: ignore[union-attr]
        index, info.length = MetadataIndex(CRAFTED_KEY, torch.Size([0]), 0), 128
    else:
        info.offset = 2**62
    metadata.storage_data[index] = info
    with open(path, "wb") as handle:
        pickle.dump(metadata, handle)
    match_checksums(iter_dir)


CRAFTED = {
    "bytes": f"'{CRAFTED_KEY}' holds bytes, not a tensor",
    "huge": f"tensor '{CRAFTED_KEY}' has shape [1000000000000] in the checkpoint but [128, 32] in this model",
    "extent": f"__0_0.distcp is too short for {CRAFTED_KEY}: the index places it at bytes 4,611,686,018,427,387,904",
}


@pytest.mark.parametrize("entry", sorted(CRAFTED))
def test_verify_refuses_what_the_loaders_refuse(two_checkpoints, tmp_path, capsys, entry):
    """Before: --verify said OK for a model entry that is a bytes blob or a [10**12] tensor in 128 bytes, which
    every loader refuses; a chunk placed past its file's end loaded as "OSError: [Errno 22] Invalid argument"."""
    root = copy_tree(two_checkpoints, str(tmp_path / "checkpoints"))
    _craft_metadata(os.path.join(root, "iter_0000004"), entry)
    assert checkpoint_info.main([root, "--verify"]) == 1
    failed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("verify: FAILED")]
    assert len(failed) == 1 and CRAFTED[entry] in failed[0], failed
    assert convert_checkpoint.main(["to-hf", root, str(tmp_path / "hf")]) == EXIT_INPUT_ERROR
    line = one_error_line(capsys)
    assert CRAFTED[entry] in line and root in line, line
    assert not os.path.exists(tmp_path / "hf")


@pytest.fixture(scope="module")
def nan_hf_folder(two_checkpoints, tmp_path_factory) -> str:
    """A transformers folder of the tiny model with one NaN in a weight (a bad export)."""
    from safetensors.torch import load_file, save_file

    folder = str(tmp_path_factory.mktemp("hf") / "hf")
    convert_checkpoint.to_hf(two_checkpoints, folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    name = sorted(n for n in tensors if n.endswith("weight"))[0]
    tensors[name][0].view(-1)[0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("tool", ["from-hf", "generate"])
def test_nan_weights_are_refused(nan_hf_folder, tmp_path, capsys, tool):
    out = str(tmp_path / "converted")
    if tool == "from-hf":
        code = convert_checkpoint.main(["from-hf", nan_hf_folder, out])
    else:
        code = generate.main(["--checkpoint", nan_hf_folder, "--prompt", "x", "--max-new-tokens", "2"])
    assert code == 2
    line = one_error_line(capsys)
    assert nan_hf_folder in line and "non-finite values (NaN or inf)" in line
    assert not os.path.exists(out)
