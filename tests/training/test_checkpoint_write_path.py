"""The save path's shortcuts change nothing on disk: pieces handed to DCP as aliases of exactly their own bytes
(no clone) give the same data file as DCP's own clone, and the CRC-32s taken while writing are those of the
files as read back."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkpoint import files
from checkpoint.dcp_planners import GlobalPieces, PiecesSavePlanner, exact_storage
from checkpoint.loader import read_global_tensors
from checkpoint.saver import SaveJob, write_checkpoint

pytestmark = pytest.mark.tier("fast")


def _pieces() -> dict[str, GlobalPieces]:
    """Views into two flat buffers, as an optimizer segment's moments and the parameters are."""
    moments = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    weights = torch.randn(600, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    return {
        "optim.exp_avg.w": GlobalPieces((30, 10), [((0, 0), moments[:300].view(30, 10))]),
        "optim.exp_avg.b": GlobalPieces((700,), [((0,), moments[300:])]),
        "w": GlobalPieces((20, 10), [((0, 0), weights[100:300].view(20, 10))]),
        "b": GlobalPieces((400, 1), [((0, 0), weights[200:].view(400, 1))]),
    }


class _ClonedByDcp(PiecesSavePlanner):
    """The planner as it was: each piece handed over as a view of its larger buffer (DCP clones it)."""

    def resolve_data(self, write_item):
        index = write_item.index
        return self.pieces[index.fqn].piece_at(index.fqn, index.offset)


def test_exact_storage_aliases_the_view_without_copying():
    flat = torch.arange(100, dtype=torch.float32)
    view = flat[10:40].view(3, 10)
    alias = exact_storage(view)
    assert torch.equal(alias, view) and alias.data_ptr() == view.data_ptr()
    assert alias.untyped_storage().nbytes() == view.nbytes == 120
    assert exact_storage(flat) is flat  # already exact
    transposed = flat.view(10, 10).t()
    assert exact_storage(transposed) is transposed  # non-contiguous: handed on as it is (DCP clones it)


def test_trainer_save_writes_the_bytes_dcp_writes_and_checksums_them(tmp_path, monkeypatch):
    tensors = _pieces()
    read_back: list[str] = []
    real_checksums = files.checksum_files

    def recording(directory: str, names: list[str]) -> dict[str, dict]:
        read_back.extend(names)
        return real_checksums(directory, names)

    monkeypatch.setattr(files, "checksum_files", recording)
    written = write_checkpoint(SaveJob(str(tmp_path / "trainer"), 5, tensors, None, keep_last=0)).path
    reference = str(tmp_path / "reference")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(reference), planner=_ClonedByDcp(), no_dist=True)
    data_files = sorted(name for name in os.listdir(written) if name.endswith(".distcp"))
    assert data_files == sorted(name for name in os.listdir(reference) if name.endswith(".distcp"))
    assert read_back and not set(read_back) & set(data_files)  # data files summed as written, not re-read
    for name in data_files:
        with open(os.path.join(written, name), "rb") as mine, open(os.path.join(reference, name), "rb") as theirs:
            assert mine.read() == theirs.read(), name
    listed = files.read_checksums(written)
    for name in data_files:
        path = os.path.join(written, name)
        assert listed[name] == {"size": os.path.getsize(path), "crc32": files.file_crc32(path)}
    files.verify_files(written)  # every listed file, every byte
    back = read_global_tensors(written)
    for key, pieces in tensors.items():
        assert torch.equal(back[key], pieces.pieces[0][1]), key


def test_file_crc32_reads_across_blocks(tmp_path):
    import zlib

    data = os.urandom(3 * 4096 + 17)
    path = tmp_path / "blob"
    path.write_bytes(data)
    for block in (4096, 1 << 24):
        assert files.file_crc32(str(path), block) == zlib.crc32(data)
    (tmp_path / "empty").write_bytes(b"")
    assert files.file_crc32(str(tmp_path / "empty")) == 0
