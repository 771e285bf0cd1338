"""Exported weights get the umask's mode: safetensors creates its files 0600, which teammates cannot read."""

import os

import pytest
import torch

from convert.hf_folder import write_weights

pytestmark = pytest.mark.tier("fast")


@pytest.mark.parametrize("max_shard_bytes", [10**9, 100], ids=["single", "sharded"])
def test_exported_safetensors_follow_the_umask(tmp_path, max_shard_bytes):
    previous = os.umask(0o022)
    try:
        names = write_weights(str(tmp_path), {"a": torch.zeros(8), "b": torch.ones(40)}, max_shard_bytes)
    finally:
        os.umask(previous)
    assert len(names) == (1 if max_shard_bytes > 1000 else 3)
    assert {name: os.stat(tmp_path / name).st_mode & 0o777 for name in names} == {name: 0o644 for name in names}
