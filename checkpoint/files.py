"""The checkpoint folder on disk: names, trackers, atomic writes, checksums, completeness, clean-up.

checkpoints/iter_0000100/            one complete checkpoint (renamed into place when complete)
    .metadata  __<rank>_<n>.distcp   torch.distributed.checkpoint: every tensor under its global name
    meta.json                        iteration, counters, layout, LR schedule, optimizer scalars, run config
    rng/rank_00003.pt                each rank's RNG states (layout-specific)
    checksums.json                   size and CRC-32 of every file above (written last)
checkpoints/iter_0000200.tmp.<pid>   a save in progress (pid of rank 0); never loaded
checkpoints/latest_checkpointed_iteration.txt, checkpoints/latest   the trackers (written after the rename)

The names Megatron-LM's checkpoints share (iter_XXXXXXX, the tracker, mp_rank_TT_PPP): folder_names.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from checkpoint.folder_names import ITER_RE, MP_RANK_PREFIX, TRACKER, iter_name
from data.atomic_files import pid_alive

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

ALIAS = "latest"
META = "meta.json"
CHECKSUMS = "checksums.json"
DCP_METADATA = ".metadata"
DATA_SUFFIX = ".distcp"  # DCP's data files, __<rank>_<n>.distcp: a load takes their CRC-32 as it reads them
TMP_RE = re.compile(r"\.tmp\.(\d+)$")
FORMAT_VERSION = 2  # 1: the per-rank mp_rank_XX_YYY files of earlier versions (checkpoint/legacy.py)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used or written: one line naming the file, key or value."""


class ChecksumError(CheckpointError):
    """A file whose size or bytes are not those checksums.json lists: the verdict that explains any other error
    reading it (a load reports it before what the damage did to a record)."""


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(data: bytes, path: str) -> None:
    """Write path.tmp.<pid>, fsync, rename over path."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_text(text: str, path: str) -> None:
    atomic_write_bytes(text.encode("utf-8"), path)


def write_json(obj: object, path: str) -> None:
    atomic_write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n", path)


def read_tracker(root: str) -> int | None:
    """The iteration the tracker names, or None without a tracker; CheckpointError if it is unreadable."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            text: str | None = handle.read(64).strip()  # an iteration number is short; junk is not read whole
    except (OSError, ValueError):  # ValueError: not UTF-8 text
        text = None
    if text is not None and text.isdigit():
        return int(text)
    shown = f"holds {text!r}" if text is not None else "is not text"
    raise CheckpointError(
        f"checkpoint tracker {path} {shown}, not an iteration number: delete it (the newest complete iter_* "
        "folder is found without it) or write the iteration into it"
    )


def list_iterations(root: str) -> list[int]:
    """Iterations of the renamed-into-place iter_XXXXXXX folders under root, ascending."""
    if not os.path.isdir(root):
        return []
    found = (ITER_RE.match(name) for name in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


def file_crc32(path: str, block: int = 1 << 24) -> int:
    """CRC-32 of the file at `path`. A second thread reads the next block while this one checksums the last
    (both release the GIL), so verifying a file from disk takes about the longer of the read and the CRC,
    not their sum (CRC-32 runs at ~1.9 GB/s here, as fast as the disk reads)."""
    crc, buffers, current = 0, (bytearray(block), bytearray(block)), 0
    with open(path, "rb", buffering=0) as handle, ThreadPoolExecutor(1, "checkpoint-read") as reader:
        if hasattr(os, "posix_fadvise"):  # Linux: a larger read-ahead (macOS has no posix_fadvise)
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        pending = reader.submit(handle.readinto, buffers[current])
        while count := pending.result():
            ready = memoryview(buffers[current])[:count]
            current ^= 1
            pending = reader.submit(handle.readinto, buffers[current])
            crc = zlib.crc32(ready, crc)
    return crc


def checksum_files(directory: str, names: list[str]) -> dict[str, dict]:
    """{relative name: {"size", "crc32"}} of files under directory, each fsynced first."""
    out = {}
    for name in names:
        path = os.path.join(directory, name)
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
        out[name] = {"size": os.path.getsize(path), "crc32": file_crc32(path)}
    return out


def read_checksums(iter_dir: str) -> dict[str, dict]:
    path = os.path.join(iter_dir, CHECKSUMS)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {iter_dir} has no {CHECKSUMS}: it is incomplete or not a checkpoint")
    try:
        with open(path, encoding="utf-8") as handle:
            listed = json.load(handle)["files"]
        if isinstance(listed, dict) and all(isinstance(entry, dict) for entry in listed.values()):
            return listed
    except (ValueError, KeyError, TypeError):
        pass
    raise CheckpointError(f"checkpoint file {path} is corrupt (not the expected JSON)")


def is_data_file(name: str) -> bool:
    """A DCP data file (the tensors), as named in checksums.json."""
    return name.endswith(DATA_SUFFIX)


def checksum_error(path: str) -> ChecksumError:
    """The one error for a file whose bytes are not those checksums.json lists."""
    return ChecksumError(f"checkpoint file {path} fails its checksum (corrupted on disk)")


def size_error(path: str, size: int, written: int) -> ChecksumError:
    """The one error for a file whose size is not the one checksums.json lists."""
    return ChecksumError(f"checkpoint file {path} is {size} bytes, {written} were written (truncated or torn)")


def verify_files(iter_dir: str, names: list[str] | None = None, full: bool = True, data_crc: bool = True) -> None:
    """Check sizes (and with full=True every byte's CRC-32) against checksums.json; CheckpointError
    naming the first bad file. data_crc=False: the data files' sizes only, for a load that takes their CRC-32
    from the bytes it reads (checkpoint/dcp_reader.py), so that they are read once."""
    expected = read_checksums(iter_dir)
    for name in sorted(expected) if names is None else names:
        path, want = os.path.join(iter_dir, name), expected[name]
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint file {path} is missing")
        size = os.path.getsize(path)
        if size != want["size"]:
            raise size_error(path, size, want["size"])
        if full and (data_crc or not is_data_file(name)) and file_crc32(path) != want["crc32"]:
            raise checksum_error(path)


def read_meta(iter_dir: str) -> dict:
    path = os.path.join(iter_dir, META)
    try:
        with open(path, encoding="utf-8") as handle:
            meta = json.load(handle)
    except OSError:
        raise CheckpointError(f"checkpoint {iter_dir} has no readable {META}") from None
    except ValueError:
        raise CheckpointError(f"checkpoint file {path} is corrupt (not JSON)") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint file {path} is corrupt (not a JSON object)")
    return meta


def check_storage_extents(iter_dir: str, metadata: Metadata) -> None:
    """Every chunk a torch.distributed.checkpoint index (`metadata.storage_data`) places lies inside an existing
    file of iter_dir: CheckpointError naming a missing or truncated file before DCP trips over it."""
    sizes: dict[str, int] = {}  # bytes of each data file, stat'ed once (an index lists thousands of chunks)
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        path = os.path.join(iter_dir, info.relative_path)
        if path not in sizes:
            if not os.path.isfile(path):
                raise CheckpointError(f"checkpoint file {path} (holding {index.fqn}) is missing")
            sizes[path] = os.path.getsize(path)
        if info.offset < 0 or info.length < 0:
            raise CheckpointError(
                f"the index of {iter_dir} places {index.fqn} at a negative extent of {path} (damaged)"
            )
        if info.offset + info.length > sizes[path]:
            raise CheckpointError(
                f"checkpoint file {path} is too short for {index.fqn}: the index places it at bytes "
                f"{info.offset:,} to {info.offset + info.length:,} of a {sizes[path]:,}-byte file (truncated, or "
                "the index is damaged)"
            )


def is_legacy(iter_dir: str) -> bool:
    """The per-rank format of earlier versions (mp_rank_XX_YYY folders, no meta.json)."""
    return (
        not os.path.exists(os.path.join(iter_dir, META))
        and os.path.isdir(iter_dir)
        and any(name.startswith(MP_RANK_PREFIX) for name in os.listdir(iter_dir))
    )


def is_complete(iter_dir: str, full: bool = False) -> bool:
    """Renamed into place with meta, DCP metadata and every listed file of the right size (full: CRC too)."""
    if is_legacy(iter_dir):
        return True
    try:
        verify_files(iter_dir, full=full)
    except CheckpointError:
        return False
    return os.path.exists(os.path.join(iter_dir, META)) and os.path.exists(os.path.join(iter_dir, DCP_METADATA))


def newest_complete(root: str, log: Callable[[str], None], candidates: list[int] | None = None) -> int | None:
    """The newest iteration (of candidates, default all) whose files all verify (others are logged)."""
    for iteration in reversed(list_iterations(root) if candidates is None else candidates):
        directory = os.path.join(root, iter_name(iteration))
        if is_complete(directory, full=True):
            return iteration
        log(f"checkpoint {directory} does not verify: skipped")
    return None


def resolve_checkpoint(path: str) -> str:
    """A checkpoints folder (-> its latest complete iteration: the tracker's, or without a tracker the newest
    that verifies) or one iter_XXXXXXX folder -> the iteration folder. CheckpointError (one line) otherwise."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint path {path} does not exist or is not a folder")
    name = os.path.basename(path)
    if ITER_RE.match(name):
        if not (is_legacy(path) or os.path.exists(os.path.join(path, META))):
            raise CheckpointError(f"{path} is not a complete checkpoint (no {META})")
        return path
    if TMP_RE.search(name):
        raise CheckpointError(f"{path} is a save that did not complete; it cannot be loaded")
    iteration = read_tracker(path)
    newer = [i for i in list_iterations(path) if iteration is None or i > iteration]
    # No tracker (deleted), or a save that was renamed into place just before its tracker was written.
    found = newest_complete(path, lambda msg: None, newer) if newer else None
    iteration = found if found is not None else iteration
    if iteration is None:
        raise CheckpointError(f"{path} holds no complete checkpoint (no tracker, no verifying iter_* folder)")
    directory = os.path.join(path, iter_name(iteration))
    if not os.path.isdir(directory):
        raise CheckpointError(
            f"checkpoint tracker {os.path.join(path, TRACKER)} names iteration {iteration} "
            f"but {directory} does not exist"
        )
    return directory


def remove_stale_tmp(root: str, log: Callable[[str], None]) -> None:
    """Delete *.tmp.<pid> files and folders under root (one level) left by processes that are gone."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        match = TMP_RE.search(name)
        if not match or pid_alive(int(match.group(1))):
            continue
        path = os.path.join(root, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
        log(f"removed {path}, left by an interrupted save (process {match.group(1)} is gone)")


def write_trackers(root: str, iteration: int) -> None:
    atomic_write_text(f"{iteration}\n", os.path.join(root, TRACKER))
    atomic_write_text(f"{iteration}\n", os.path.join(root, ALIAS))


def prune(root: str, keep_last: int, log: Callable[[str], None]) -> None:
    """Delete all but the newest keep_last complete checkpoints (called after a newer one is complete)."""
    if keep_last <= 0:
        return
    for iteration in list_iterations(root)[:-keep_last]:
        path = os.path.join(root, iter_name(iteration))
        shutil.rmtree(path, ignore_errors=True)
        log(f"checkpoint.keep_last={keep_last}: deleted {path}")


def dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(base, name)) for base, _, names in os.walk(path) for name in names)
