"""The one-pass load (checkpoint/dcp_reader.py, checkpoint/record_reader.py): each data file read once, its
CRC-32 taken from the bytes the tensors are read from. It fills the pieces bitwise as DCP's own reader does
(whole chunks, resharded parts, another dtype), reads every tensor record straight into place, fails with the
one line naming a damaged file (on every rank), verifies files no read needs, and runs nothing a file holds."""

from __future__ import annotations

import io
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import pretrain_gpt
from checkpoint import dcp_reader, files
from checkpoint.dcp_planners import GlobalPieces, PiecesLoadPlanner
from checkpoint.loader import load_pieces, read_global_tensors, verify_share
from checkpoint.record_reader import locate_tensor_data
from checkpoint.safe_reader import read_metadata_file
from checkpoint.saver import SaveJob, write_checkpoint
from parallel.comm import Collectives
from tests.conftest import run_ranks, tiny_train_args
from tests.payloads import CreatesFile, assert_payload_is_live

pytestmark = pytest.mark.tier("fast")

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool)


def _stored() -> dict[str, torch.Tensor]:
    """Tensors of every dtype a trainer checkpoint holds and a few more, views into larger buffers as pieces are,
    of shapes from a scalar to 3-D, one empty and one over BLOCK-sized reads."""
    generator = torch.Generator().manual_seed(0)
    flat = torch.randn(5000, generator=generator)
    out = {f"t.{dtype}".replace("torch.", ""): (flat[:600] * 50).to(dtype).view(20, 30) for dtype in DTYPES}
    out["moments.view"] = flat[1000:1600].view(4, 10, 15)
    out["scalar"] = flat[7].clone().reshape(())
    out["empty"] = flat[:0].view(0, 3)
    out["large"] = torch.randn(3000, 1000, generator=generator)  # 12 MB: crosses the 8 MiB read blocks
    return out


def _save(root: str, stored: dict[str, torch.Tensor]) -> str:
    pieces = {key: GlobalPieces(tuple(t.shape), [((0,) * t.ndim, t)]) for key, t in stored.items()}
    return write_checkpoint(SaveJob(root, 1, pieces, None, keep_last=0)).path


def _empty_like(stored: dict[str, torch.Tensor]) -> dict[str, GlobalPieces]:
    return {key: GlobalPieces(tuple(t.shape), [((0,) * t.ndim, torch.zeros_like(t))]) for key, t in stored.items()}


def _dcp_reference(iter_dir: str, wanted: dict[str, GlobalPieces]) -> None:
    """The same pieces read by DCP's own FileSystemReader (a torch.load per record, then a copy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(wanted, storage_reader=dcp.FileSystemReader(iter_dir), planner=PiecesLoadPlanner(), no_dist=True)


def _one_pass(iter_dir: str, wanted: dict[str, GlobalPieces]) -> None:
    load_pieces(iter_dir, wanted, dcp_reader.read_dcp_metadata(iter_dir), None, files.read_checksums(iter_dir))


@pytest.fixture
def deserialised(monkeypatch) -> list[str]:
    """The records the reader hands to torch.load (the fallback): none for a trainer's checkpoint."""
    calls: list[str] = []
    real = dcp_reader.load_weights_bytes

    def counting(data: bytes, source: str):
        calls.append(source)
        return real(data, source)

    monkeypatch.setattr(dcp_reader, "load_weights_bytes", counting)
    return calls


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))
    )


def test_one_pass_fills_the_pieces_bitwise_as_dcp_reads_them(tmp_path, deserialised):
    stored = _stored()
    iter_dir = _save(str(tmp_path), stored)
    mine, reference = _empty_like(stored), _empty_like(stored)
    _one_pass(iter_dir, mine)
    _dcp_reference(iter_dir, reference)
    for key, tensor in stored.items():
        assert _bitwise_equal(mine[key].pieces[0][1], tensor), key
        assert _bitwise_equal(mine[key].pieces[0][1], reference[key].pieces[0][1]), key
    assert deserialised == []  # every record read straight into its destination, none through torch.load
    back = read_global_tensors(iter_dir)  # the tools' path (no checksums) reads the same
    assert all(_bitwise_equal(back[key], tensor) for key, tensor in stored.items())


def test_resharded_parts_and_another_dtype_as_dcp_reads_them(tmp_path, deserialised):
    """Pieces that take part of a stored chunk, two pieces of one chunk, and a bf16 destination of an fp32
    record (a 16-bit run's weights from the fp32 masters) go through a temporary tensor of the chunk."""
    stored = _stored()
    iter_dir = _save(str(tmp_path), stored)

    def wanted() -> dict[str, GlobalPieces]:
        return {
            "large": GlobalPieces((3000, 1000), [((1000, 500), torch.zeros(1000, 500)), ((0, 0), torch.zeros(7, 3))]),
            "moments.view": GlobalPieces((4, 10, 15), [((0, 0, 0), torch.zeros(4, 10, 15, dtype=torch.bfloat16))]),
            "t.float32": GlobalPieces((20, 30), [((0, 0), torch.zeros(20, 30)), ((0, 0), torch.zeros(20, 30))]),
        }

    mine, reference = wanted(), wanted()
    _one_pass(iter_dir, mine)
    _dcp_reference(iter_dir, reference)
    for key in mine:
        for (_, got), (_, expected) in zip(mine[key].pieces, reference[key].pieces):
            assert _bitwise_equal(got, expected), key
    assert torch.equal(mine["large"].pieces[0][1], stored["large"][1000:2000, 500:1000])
    assert deserialised == []


def test_each_data_file_is_read_once(tmp_path, monkeypatch):
    """The resume's verification leaves the data files to the load, which reads each byte of them once."""
    iter_dir = _save(str(tmp_path), _stored())
    summed: list[str] = []
    real_crc = files.file_crc32

    def summing(path: str, *args) -> int:
        summed.append(path)
        return real_crc(path, *args)

    monkeypatch.setattr(files, "file_crc32", summing)
    bytes_read: dict[str, int] = {}
    real_read_into = dcp_reader.ChecksummedFile.read_into

    def counting(self, view):
        bytes_read[self.path] = bytes_read.get(self.path, 0) + len(view)
        return real_read_into(self, view)

    monkeypatch.setattr(dcp_reader.ChecksummedFile, "read_into", counting)
    verify_share(iter_dir, Collectives(), data_crc=False)
    _one_pass(iter_dir, _empty_like(_stored()))
    data_files = [os.path.join(iter_dir, name) for name in files.read_checksums(iter_dir) if files.is_data_file(name)]
    assert data_files and not set(summed) & set(data_files)  # not summed in a pass of their own
    assert bytes_read == {path: os.path.getsize(path) for path in data_files}  # each byte once


def _flip(path: str, where: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(where)
        byte = handle.read(1)
        handle.seek(where)
        handle.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("where", ["tensor data", "first record's header", "last record's zip directory"])
def test_a_corrupted_byte_fails_the_load_with_one_line_naming_the_file(tmp_path, where):
    stored = _stored()
    iter_dir = _save(str(tmp_path), stored)
    (name,) = [name for name in os.listdir(iter_dir) if files.is_data_file(name)]
    path = os.path.join(iter_dir, name)
    size = os.path.getsize(path)
    _flip(
        path, {"tensor data": size // 2, "first record's header": 40, "last record's zip directory": size - 30}[where]
    )
    verify_share(iter_dir, Collectives(), data_crc=False)  # sizes are right: only the load can tell
    with pytest.raises(files.CheckpointError) as raised:
        _one_pass(iter_dir, _empty_like(stored))
    assert str(raised.value) == f"checkpoint file {path} fails its checksum (corrupted on disk)"


def _save_file_per_tensor(iter_dir: str, stored: dict[str, torch.Tensor]) -> None:
    """A checkpoint whose every tensor lies in a data file of its own (DCP's single_file_per_rank=False), with
    its checksums.json; what a load at fewer ranks than the save meets, one file per saving rank."""
    pieces = {key: GlobalPieces(tuple(t.shape), [((0,) * t.ndim, t)]) for key, t in stored.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from checkpoint.dcp_planners import PiecesSavePlanner

        writer = dcp.FileSystemWriter(iter_dir, single_file_per_rank=False)
        dcp.save(pieces, storage_writer=writer, planner=PiecesSavePlanner(), no_dist=True)
    names = sorted(os.listdir(iter_dir))
    files.write_json({"files": files.checksum_files(iter_dir, names)}, os.path.join(iter_dir, files.CHECKSUMS))


def test_files_read_in_parallel_and_a_file_no_read_needs_is_verified(tmp_path, monkeypatch):
    stored = {f"w{i}": torch.randn(50, 40, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    iter_dir = str(tmp_path / "ckpt")
    _save_file_per_tensor(iter_dir, stored)
    threads: set[str] = set()
    real_read_file = dcp_reader.SafeFileSystemReader._read_file

    def recording(self, name, records, verify):
        import threading

        threads.add(threading.current_thread().name)
        return real_read_file(self, name, records, verify)

    monkeypatch.setattr(dcp_reader.SafeFileSystemReader, "_read_file", recording)
    wanted = _empty_like({key: stored[key] for key in ("w0", "w1", "w2")})
    _one_pass(iter_dir, wanted)
    assert all(torch.equal(wanted[key].pieces[0][1], stored[key]) for key in wanted)
    assert len(threads) > 1  # several files at once
    metadata = read_metadata_file(os.path.join(iter_dir, files.DCP_METADATA))
    unread = sorted({info.relative_path for index, info in metadata.storage_data.items() if index.fqn == "w5"})
    _flip(os.path.join(iter_dir, unread[0]), 100)
    with pytest.raises(files.CheckpointError, match=f"{unread[0]} fails its checksum"):
        _one_pass(iter_dir, _empty_like({key: stored[key] for key in ("w0", "w1", "w2")}))


def test_a_record_that_pickles_code_is_refused_and_nothing_runs(tmp_path):
    """A data file's record replaced by a pickle that runs a command (checksums and index rewritten to match,
    as whoever crafts it can): refused in one line naming the file, the command never run."""
    marker = str(tmp_path / "ran")
    assert_payload_is_live(marker)
    stored = {"w": torch.randn(8, 4), "b": torch.randn(8)}
    iter_dir = str(tmp_path / "ckpt")
    _save_file_per_tensor(iter_dir, stored)
    metadata_path = os.path.join(iter_dir, files.DCP_METADATA)
    metadata = read_metadata_file(metadata_path)
    (info,) = [info for index, info in metadata.storage_data.items() if index.fqn == "w"]
    crafted = io.BytesIO()
    torch.save({"payload": CreatesFile(marker)}, crafted)
    with open(os.path.join(iter_dir, info.relative_path), "wb") as handle:
        handle.write(crafted.getvalue())
    info.offset, info.length = 0, len(crafted.getvalue())
    with open(metadata_path, "wb") as handle:
        pickle.dump(metadata, handle)
    names = sorted(files.read_checksums(iter_dir))
    files.write_json({"files": files.checksum_files(iter_dir, names)}, os.path.join(iter_dir, files.CHECKSUMS))
    with pytest.raises(files.CheckpointError) as raised:
        _one_pass(iter_dir, _empty_like(stored))
    line = str(raised.value)
    assert "\n" not in line and info.relative_path in line and "not on the allow-list" in line, line
    assert not os.path.exists(marker), "the payload ran"


def test_records_the_reader_does_not_read_itself_are_located_as_none():
    def record(value) -> bytes:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return buffer.getvalue()

    tensor = torch.arange(12, dtype=torch.float32).view(3, 4)
    data = record(tensor)
    start = locate_tensor_data(data[:4096], torch.float32, (3, 4))
    assert start is not None and data[start : start + 48] == tensor.numpy().tobytes()
    assert locate_tensor_data(data[:4096], torch.float64, (3, 4)) is None  # another dtype than the index's
    assert locate_tensor_data(data[:4096], torch.float32, (4, 3)) is None  # another shape
    assert locate_tensor_data(record(torch.arange(20.0)[5:17].view(3, 4)), torch.float32, (3, 4)) is None  # offset
    assert locate_tensor_data(record(tensor.t()), torch.float32, (4, 3)) is None  # not contiguous
    assert locate_tensor_data(record({"w": tensor}), torch.float32, (3, 4)) is None  # not one tensor
    assert locate_tensor_data(data[:100], torch.float32, (3, 4)) is None  # the pickle cut short


def _two_rank_load(rank: int, world_size: int, root: str, out_dir: str) -> None:
    """Each rank saves its half of "w" (rows) into its own file, rank 0 damages rank 1's file, each rank loads its
    half: both ranks must fail with the same line naming that file."""
    full = torch.arange(40, dtype=torch.float32).view(8, 5)
    half = full[4 * rank : 4 * rank + 4].clone()
    iter_dir = write_checkpoint(SaveJob(root, 1, {"w": GlobalPieces((8, 5), [((4 * rank, 0), half)])}, None, 0)).path
    damaged = os.path.join(iter_dir, "__1_0.distcp")
    if rank == 0:
        _flip(damaged, os.path.getsize(damaged) // 2)
    dist.barrier()
    target = torch.zeros(4, 5)
    try:
        _one_pass(iter_dir, {"w": GlobalPieces((8, 5), [((4 * rank, 0), target)])})
        message = "loaded"
    except files.CheckpointError as err:
        message = str(err)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w", encoding="utf-8") as handle:
        handle.write(message)


def test_a_damaged_file_fails_the_load_on_every_rank(tmp_path):
    root = str(tmp_path / "checkpoints")
    run_ranks(2, _two_rank_load, root, str(tmp_path))
    messages = {(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)}
    damaged = os.path.join(root, "iter_0000001", "__1_0.distcp")
    assert messages == {f"checkpoint file {damaged} fails its checksum (corrupted on disk)"}


def _folder_contents(root: str) -> dict[str, bytes]:
    contents = {}
    for base, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(base, name), "rb") as handle:
                contents[os.path.relpath(os.path.join(base, name), root)] = handle.read()
    return contents


def test_the_trainer_refuses_a_corrupted_data_file_and_writes_nothing(tiny_corpus, tmp_path, capsys):
    """The data files are verified only as the resume loads them, after the model is built: the run still exits
    2 with the one line naming the file, and its folder (config.yaml, metrics, TensorBoard, checkpoints) is
    byte for byte as it was."""
    run_dir = str(tmp_path / "run")

    def main(*extra: str) -> int:
        argv = tiny_train_args(tiny_corpus, run_dir, "train.eval_iters=0", "logging.tensorboard=true", *extra)
        return pretrain_gpt.main(["--config", pretrain_gpt.DEFAULT_CONFIG, *argv])

    assert main("train.train_iters=2") == 0
    data = os.path.join(run_dir, "checkpoints", "iter_0000002", "__0_0.distcp")
    _flip(data, os.path.getsize(data) // 2)
    before = _folder_contents(run_dir)
    capsys.readouterr()
    assert main("train.train_iters=4", "checkpoint.load=true") == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: checkpoint file {data} fails its checksum (corrupted on disk)"
    ]
    assert _folder_contents(run_dir) == before
