"""checkpoint/safe_reader.py on its own: the DCP metadata of a real checkpoint reads; a crafted one is
refused in one line naming the file (a payload, a data file outside the folder, a malformed index, a torn
file) and nothing runs; pickled .pt files are read weights-only with the same kind of refusal."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from checkpoint.dcp_reader import read_dcp_metadata
from checkpoint.files import CheckpointError
from checkpoint.safe_reader import load_weights_file
from tests.payloads import PAYLOAD_GLOBAL, CreatesFile, arm_dcp_metadata, arm_torch_file

pytestmark = pytest.mark.tier("fast")

FIXTURE = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "fixtures", "checkpoint_format2", "checkpoints", "iter_0000004"
)


@pytest.fixture
def iter_dir(tmp_path) -> str:
    path = str(tmp_path / "iter_0000004")
    shutil.copytree(FIXTURE, path)
    return path


def _rewrite(iter_dir: str, metadata) -> str:
    path = os.path.join(iter_dir, ".metadata")
    with open(path, "wb") as handle:
        pickle.dump(metadata, handle)
    return path


def test_a_real_checkpoint_reads():
    metadata = read_dcp_metadata(FIXTURE)
    assert isinstance(metadata, Metadata) and "embedding.word_embeddings.weight" in metadata.state_dict_metadata


def test_a_payload_is_refused_by_name(iter_dir, marker):
    path = arm_dcp_metadata(iter_dir, marker)
    with pytest.raises(CheckpointError) as err:
        read_dcp_metadata(iter_dir)
    assert str(err.value) == (
        f"{path} pickles {PAYLOAD_GLOBAL}, which is not on the allow-list "
        "(torch.distributed.checkpoint metadata classes, torch.Size, dtypes)"
    )
    assert not os.path.exists(marker)


def test_a_data_file_outside_the_folder_is_refused(iter_dir):
    metadata = read_dcp_metadata(iter_dir)
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = _StorageInfo("../../etc/passwd", 0, 8)
    path = _rewrite(iter_dir, metadata)
    with pytest.raises(CheckpointError, match="index of data files is malformed") as err:
        read_dcp_metadata(iter_dir)
    assert str(err.value).startswith(path)


@pytest.mark.parametrize("damage", ["no-fields", "not-metadata", "torn", "missing"])
def test_a_damaged_index_is_one_line(iter_dir, damage):
    path = os.path.join(iter_dir, ".metadata")
    if damage == "no-fields":  # the allowed class, built without its fields
        metadata = Metadata.__new__(Metadata)
        _rewrite(iter_dir, metadata)
    elif damage == "not-metadata":
        _rewrite(iter_dir, {"state_dict_metadata": {}})
    elif damage == "torn":
        with open(path, "r+b") as handle:
            handle.truncate(os.path.getsize(path) // 2)
    else:
        os.remove(path)
    with pytest.raises(CheckpointError) as err:
        read_dcp_metadata(iter_dir)
    assert str(err.value).startswith(path) and "\n" not in str(err.value)


def test_pt_files_are_read_weights_only(tmp_path, marker):
    plain = str(tmp_path / "plain.pt")
    torch.save({"weight": torch.ones(2), "step": 3}, plain)
    assert load_weights_file(plain)["step"] == 3
    armed = arm_torch_file(str(tmp_path / "armed.pt"), marker)
    with pytest.raises(CheckpointError, match=f"^{armed} pickles {PAYLOAD_GLOBAL}, which is not on the allow-list"):
        load_weights_file(armed)
    raw = str(tmp_path / "raw.pt")  # a bare pickle, not a torch.save file
    with open(raw, "wb") as handle:
        pickle.dump(CreatesFile(marker), handle)
    with pytest.raises(CheckpointError, match=f"^{raw} "):
        load_weights_file(raw)
    assert not os.path.exists(marker)
