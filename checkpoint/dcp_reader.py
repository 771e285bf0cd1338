"""`SafeFileSystemReader`, and `read_dcp_metadata` through it: the torch.distributed.checkpoint FileSystemReader
every load goes through. Its `.metadata` is read by checkpoint/safe_reader.py's allow-list unpickler, and its
data files are read in one pass each (checkpoint/record_reader.py): front to back with large reads, the CRC-32
of checksums.json taken from the same bytes, and each tensor's bytes read straight into the model or optimizer
tensor they belong to where the record is that tensor's dtype and shape (else torch.load(weights_only=True) of
the record, DCP's own way). DCP's reader read each record with its own seek and torch.load and copied it into
place; with the verification before it, every byte was read twice and copied three times.

In a module of its own because subclassing FileSystemReader imports DCP (~1.3 CPU s: DTensor's operator
strategies and sympy), which a run that neither saves nor loads, a config error or --help never needs: this
module is imported where a checkpoint is read.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from checkpoint import files
from checkpoint.dcp_planners import narrow_view
from checkpoint.files import DCP_METADATA, CheckpointError
from checkpoint.record_reader import HEAD, ChecksummedFile, descriptor_matches, locate_tensor_data
from checkpoint.safe_reader import load_weights_bytes, read_metadata_file

FILE_THREADS = 4  # data files read at once by one process (a load at a layout with fewer ranks reads several)
DESCRIPTOR_BYTES = 24  # the longest zip data descriptor (zip64), read after a tensor's bytes to check them


class _Read(NamedTuple):
    """One ReadItem of the plan and, for a tensor, the view of its destination it fills."""

    item: ReadItem
    destination: torch.Tensor | None


class _FileResult(NamedTuple):
    """What reading one data file gave: its error (None: read and, if asked, verified) and the byte entries
    read (delivered to the planner once every file is verified)."""

    error: CheckpointError | None
    byte_records: list[tuple[ReadItem, bytes]]


class SafeFileSystemReader(dcp.FileSystemReader):
    """FileSystemReader whose `.metadata` goes through `read_metadata_file` (never pickle.load), read once:
    `metadata`, when given, is the object the caller already read and checked. With `checksums` (checksums.json's
    {name: {"size", "crc32"}}), every data file it lists is read whole by exactly one rank and checked against it
    as it is read, and the load fails (CheckpointError naming the file, on every rank) before it returns."""

    def __init__(
        self,
        path: str,
        metadata: Metadata | None = None,
        checksums: Mapping[str, Mapping[str, int]] | None = None,
    ) -> None:
        super().__init__(path)
        self.checked_metadata = metadata
        self.checksums = checksums

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's index (also when DCP asks for a rank's own: only the folder's `.metadata` is read)."""
        if self.checked_metadata is None:
            self.checked_metadata = read_metadata_file(os.path.join(str(self.path), DCP_METADATA))
        metadata = self.checked_metadata
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Deal the data files to verify over the ranks, in each plan's `storage_data`: each file to the rank that
        reads most of it (it reads it whole, once), a file no rank reads to the rank with the fewest bytes to
        verify so far. Runs on the coordinator, which sees every rank's plan."""
        if self.checksums is None:
            return plans
        wanted = {name: [0] * len(plans) for name in sorted(self.checksums) if files.is_data_file(name)}
        for rank, plan in enumerate(plans):
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                if info.relative_path in wanted:
                    wanted[info.relative_path][rank] += info.length
        assigned: list[list[str]] = [[] for _ in plans]
        verifying = [0] * len(plans)
        for name, read_by_rank in wanted.items():
            if any(read_by_rank):
                rank = max(range(len(plans)), key=lambda r: (read_by_rank[r], -verifying[r]))
            else:
                rank = min(range(len(plans)), key=verifying.__getitem__)
            assigned[rank].append(name)
            verifying[rank] += self.checksums[name]["size"]
        return [dataclasses.replace(plan, storage_data=names) for plan, names in zip(plans, assigned)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's items, each data file once (several files in parallel threads), verifying the files
        the global plan dealt to this rank; the destinations are committed to the planner only once every file
        read here has verified. CheckpointError naming the file otherwise."""
        to_verify = set(plan.storage_data or ()) if self.checksums is not None else set()
        if any(getattr(self.storage_data[item.storage_index], "transform_descriptors", None) for item in plan.items):
            return self._read_transformed(plan, planner, to_verify)
        by_file: dict[str, dict[MetadataIndex, list[_Read]]] = {}
        for item in plan.items:  # destinations resolved here: the planner is not asked from the reading threads
            destination = None if item.type == LoadItemType.BYTE_IO else planner.resolve_tensor(item).detach()
            info = self.storage_data[item.storage_index]
            by_file.setdefault(info.relative_path, {}).setdefault(item.storage_index, []).append(
                _Read(item, destination)
            )
        names = sorted(by_file.keys() | to_verify)
        with ThreadPoolExecutor(max(1, min(FILE_THREADS, len(names))), "checkpoint-read") as pool:
            results = list(
                pool.map(lambda name: self._read_file(name, by_file.get(name, {}), name in to_verify), names)
            )
        errors = [result.error for result in results if result.error is not None]
        if errors:  # a file's checksum verdict explains what its damage did to a record of another file's reader
            raise next((error for error in errors if isinstance(error, files.ChecksumError)), errors[0])
        for result in results:
            for item, data in result.byte_records:
                planner.load_bytes(item, io.BytesIO(data))
        for reads in (reads for records in by_file.values() for reads in records.values()):
            for read in reads:
                if read.destination is not None:
                    planner.commit_tensor(read.item, read.destination)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, name: str, records: dict[MetadataIndex, list[_Read]], verify: bool) -> _FileResult:
        """Read the records of one data file in the order they lie in it; with `verify`, the whole file, checked
        against checksums.json. A record that cannot be read stops the reading of records, not of the file: a
        file that fails its checksum is reported as such, whatever its damage did to a record."""
        path = os.path.join(str(self.path), name)
        byte_records: list[tuple[ReadItem, bytes]] = []
        try:
            reader = ChecksummedFile(path, verify)
        except OSError as err:
            return _FileResult(_read_error(path, err), [])
        error: CheckpointError | None = None
        try:
            for index in sorted(records, key=lambda index: self.storage_data[index].offset):
                try:
                    byte_records += self._read_record(reader, index, records[index])
                except (CheckpointError, OSError, RuntimeError, ValueError) as err:
                    error = err if isinstance(err, CheckpointError) else _read_error(path, err, index.fqn)
                    break
            if verify:
                expected = self.checksums[name] if self.checksums is not None else {}
                crc = reader.crc()
                if reader.size != expected["size"]:
                    error = files.size_error(path, reader.size, expected["size"])
                elif crc != expected["crc32"]:
                    error = files.checksum_error(path)
        except (CheckpointError, OSError) as err:  # the rest of the file could not be read for its checksum
            error = err if isinstance(err, CheckpointError) else _read_error(path, err)
        finally:
            reader.close()
        return _FileResult(error, byte_records)

    def _read_record(
        self, reader: ChecksummedFile, index: MetadataIndex, reads: list[_Read]
    ) -> list[tuple[ReadItem, bytes]]:
        """Read one record (a torch.save of one stored chunk) into the destinations of `reads`; returns the byte
        entries among them with their bytes. A record of the chunk's dtype and shape has its tensor bytes read
        straight into the destination when one read fills it whole, else into one temporary tensor."""
        info = self.storage_data[index]
        reader.advance_to(info.offset)
        head = reader.read(min(HEAD, info.length))
        chunk = self._chunk(index)
        data_start = None
        if chunk is not None and all(read.destination is not None for read in reads):
            data_start = locate_tensor_data(head, chunk.dtype, chunk.shape)
        nbytes = math.prod(chunk.shape) * chunk.dtype.itemsize if chunk is not None else 0
        if chunk is None or data_start is None or data_start + nbytes > info.length:
            record = head + reader.read(info.length - len(head))
            return self._deserialise(record, reads, reader.path, index.fqn)
        whole = reads[0].destination if len(reads) == 1 else None
        fills_whole = (
            whole is not None
            and _covers(reads[0].item, chunk.shape)
            and whole.dtype == chunk.dtype
            and tuple(whole.shape) == chunk.shape
            and whole.is_contiguous()
            and whole.is_cpu
        )
        target = whole if fills_whole and whole is not None else torch.empty(chunk.shape, dtype=chunk.dtype)
        raw = target.reshape(-1).view(torch.uint8).numpy().data  # the target's own bytes
        in_head = head[data_start : data_start + nbytes]
        raw[: len(in_head)] = in_head
        reader.read_into(raw[len(in_head) :])
        read_so_far = max(len(head), data_start + nbytes)
        after = head[data_start + nbytes :]
        after += reader.read(min(info.length - read_so_far, max(0, DESCRIPTOR_BYTES - len(after))))
        if not descriptor_matches(after, nbytes):  # not the layout it looked like: the record read whole after all
            consumed = data_start + nbytes + len(after)
            record = head[:data_start] + bytes(raw) + after + reader.read(info.length - consumed)
            reader.settle()  # `raw` may be the destination, which torch.load's result is copied into next
            return self._deserialise(record, reads, reader.path, index.fqn)
        if target is not whole:
            for read in reads:
                assert read.destination is not None, "only records of tensor reads are read this way"
                read.destination.copy_(narrow_view(target, read.item.storage_offsets, read.item.lengths))
        return []

    def _deserialise(self, record: bytes, reads: list[_Read], path: str, fqn: str) -> list[tuple[ReadItem, bytes]]:
        """DCP's way with a record: byte entries handed on as they are, tensors torch.load'ed (weights_only)."""
        tensor_reads = [read for read in reads if read.destination is not None]
        if tensor_reads:
            source = f"checkpoint file {path} (the record of {fqn})"
            tensor = load_weights_bytes(record, source)
            if not isinstance(tensor, torch.Tensor):
                raise CheckpointError(f"{source} holds a {type(tensor).__name__}, not a tensor")
            for read in tensor_reads:
                assert read.destination is not None, "tensor reads have a destination"
                part = narrow_view(tensor, read.item.storage_offsets, read.item.lengths)
                if part.shape != read.destination.shape:
                    raise CheckpointError(
                        f"{source} holds {tuple(part.shape)} where its index promises {tuple(read.destination.shape)}"
                    )
                read.destination.copy_(part)
        return [(read.item, record) for read in reads if read.destination is None]

    def _chunk(self, index: MetadataIndex) -> _Chunk | None:
        """The dtype and shape of the stored chunk `index` names (None: not a tensor chunk of the index)."""
        metadata = self.checked_metadata
        entry = metadata.state_dict_metadata.get(index.fqn) if metadata is not None else None
        if not isinstance(entry, TensorStorageMetadata):
            return None
        offsets = tuple(index.offset) if index.offset is not None else None
        for chunk in entry.chunks:
            if tuple(chunk.offsets) == offsets:
                return _Chunk(entry.properties.dtype, tuple(chunk.sizes))
        return None

    def _read_transformed(self, plan: LoadPlan, planner: LoadPlanner, to_verify: set[str]) -> Future[None]:
        """Records written through DCP's storage transforms (compression, ...; never by this trainer): DCP's own
        reader reads them, and the files dealt to this rank are verified in a pass of their own first."""
        for name in sorted(to_verify):
            path = os.path.join(str(self.path), name)
            expected = self.checksums[name] if self.checksums is not None else {}
            size = os.path.getsize(path)
            if size != expected["size"]:
                raise files.size_error(path, size, expected["size"])
            if files.file_crc32(path) != expected["crc32"]:
                raise files.checksum_error(path)
        return super().read_data(plan, planner)


class _Chunk(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]


def _covers(item: ReadItem, shape: tuple[int, ...]) -> bool:
    """The read takes the stored chunk whole."""
    return all(offset == 0 for offset in item.storage_offsets) and tuple(item.lengths) == shape


def _read_error(path: str, err: BaseException, fqn: str | None = None) -> CheckpointError:
    """One line naming the file (and the record) for an error reading it."""
    where = f"checkpoint file {path}" + (f" (the record of {fqn})" if fqn else "")
    reason = getattr(err, "strerror", None) or (str(err).strip().splitlines() or [type(err).__name__])[0]
    return CheckpointError(f"{where} cannot be read: {reason}")


def read_dcp_metadata(iter_dir: str) -> Metadata:
    """The `.metadata` of the DCP folder iter_dir, read safely (CheckpointError naming the file otherwise)."""
    return SafeFileSystemReader(iter_dir).read_metadata()
