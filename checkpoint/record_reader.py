"""Reading a checkpoint data file in one pass: front to back, every byte once, its CRC-32 taken from the same
bytes the tensors are read from, and each tensor's bytes read straight into the tensor that keeps them.

A DCP data file (`__<rank>_<n>.distcp`) is a run of torch.save records, one per stored chunk, each a zip
archive: `<name>/data.pkl` (a pickle naming the tensor's dtype, shape and storage), small entries (format
version, byte order), `<name>/data/0` (the raw bytes of the storage, stored uncompressed, 64-byte aligned) and
the zip's directory. `ChecksummedFile` reads a file strictly in order with large reads, the CRC of one block
running in a second thread while the next block is read (zlib and the read both release the GIL).
`locate_tensor_data` reads the head of a record (its headers and pickle, never its data) and says where the
raw bytes of its one tensor lie, if the record is exactly one contiguous tensor of the dtype and shape the
index promises: the pickle is only parsed (`pickletools.genops`), nothing in it is looked up or called, so
nothing in the file runs. Any other record is read whole and deserialised by torch.load(weights_only=True),
as DCP's own reader does.
"""

from __future__ import annotations

import math
import os
import pickletools
import struct
import sys
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from checkpoint.files import CheckpointError
from compat.torch_private import PICKLED_TENSOR

BLOCK = 8 << 20  # bytes per read(): large sequential reads; the CRC of one block runs while the next is read
HEAD = 4096  # bytes of a record read before its tensor data: torch.save's headers and pickle take ~700
LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header (30 bytes), signature first
LOCAL_SIGNATURE = 0x04034B50
DESCRIPTOR_SIGNATURE = b"PK\x07\x08"  # the data descriptor torch's zip writer puts after each entry's bytes
# The typed storage classes a tensor pickle names (GLOBAL torch.<name>), by the dtype of their elements.
STORAGE_DTYPES = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


class ChecksummedFile:
    """A file read strictly front to back, each byte once. With `checksum`, `crc()` is the CRC-32 of every byte
    read, summed in a second thread while the next bytes are read. The bytes read are summed in batches of at
    least BLOCK (a record's small reads, thousands of them, would otherwise each wait for that thread to wake),
    one batch in flight at a time; every buffer in a batch stays untouched until it is summed (`advance_to`'s
    two reused buffers take whole blocks, each of which sends its batch at once). Without `checksum`, skipped
    bytes are seeked past."""

    def __init__(self, path: str, checksum: bool) -> None:
        self.path = path
        self.checksum = checksum
        self.position = 0
        self._crc = 0
        self._batch: list[memoryview] = []  # read, not yet handed to the CRC thread, in file order
        self._batched = 0  # bytes in _batch
        self._pending: Future[None] | None = None
        self._summer = ThreadPoolExecutor(1, "checkpoint-crc") if checksum else None
        self.handle = open(path, "rb", buffering=0)  # noqa: SIM115 (closed by close(), the file outlives a block)
        self.size = os.fstat(self.handle.fileno()).st_size
        if hasattr(os, "posix_fadvise"):  # Linux: a larger read-ahead (macOS has no posix_fadvise)
            os.posix_fadvise(self.handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def _add(self, views: list[memoryview]) -> None:
        for view in views:
            self._crc = zlib.crc32(view, self._crc)

    def _send(self) -> None:
        """Hand the batch to the CRC thread, once the batch before it is summed (the CRC is a chain)."""
        if self._summer is None or not self._batch:
            return
        if self._pending is not None:
            self._pending.result()
        self._pending = self._summer.submit(self._add, self._batch)
        self._batch, self._batched = [], 0

    def _sum(self, view: memoryview) -> None:
        if self._summer is None:
            return
        self._batch.append(view)
        self._batched += len(view)
        if self._batched >= BLOCK:
            self._send()

    def read_into(self, view: memoryview) -> None:
        """Fill `view` with the next len(view) bytes of the file; CheckpointError naming it if it ends first.
        With `checksum`, `view` must stay untouched until the next `crc()` (the CRC thread may still read it)."""
        for start in range(0, len(view), BLOCK):
            block = view[start : start + BLOCK]
            filled = 0
            while filled < len(block):
                count = self.handle.readinto(block[filled:])
                if not count:
                    raise CheckpointError(
                        f"checkpoint file {self.path} ends at byte {self.position + filled:,}, inside a record its "
                        "index places further on (truncated)"
                    )
                filled += count
            self.position += len(block)
            self._sum(block)

    def read(self, size: int) -> bytes:
        """The next `size` bytes."""
        out = bytearray(size)
        self.read_into(memoryview(out))
        return bytes(out)

    def advance_to(self, offset: int) -> None:
        """Move forward to `offset`: with `checksum` the bytes on the way are read and summed, else seeked past."""
        if offset < self.position:
            raise CheckpointError(
                f"the index of checkpoint file {self.path} places a record at byte {offset:,}, inside the one before "
                "it (damaged index)"
            )
        if not self.checksum:
            self.handle.seek(offset)
            self.position = offset
            return
        scratch = [bytearray(BLOCK), bytearray(BLOCK)] if offset - self.position >= BLOCK else []
        current = 0
        while offset - self.position >= BLOCK:  # a whole block sends its batch at once; the next send waits for it
            self.read_into(memoryview(scratch[current]))
            current ^= 1  # so a buffer is refilled only after its batch is summed
        if self.position < offset:
            self.read(offset - self.position)  # a buffer of its own, summed with the next batch

    def settle(self) -> None:
        """Wait until every byte read so far is summed (then the buffers read into may change)."""
        self._send()
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def crc(self) -> int:
        """CRC-32 of the whole file (the rest of it read first)."""
        self.advance_to(max(self.size, self.position))
        self.settle()
        return self._crc

    def close(self) -> None:
        """Close the file and stop the CRC thread."""
        if self._summer is not None:
            self._summer.shutdown(wait=True)
        self.handle.close()


class _Global(NamedTuple):
    """A GLOBAL opcode's reference, kept as its two names (never imported)."""

    module: str
    name: str


class _Call(NamedTuple):
    """A REDUCE opcode: what unpickling would call, and with what (never called)."""

    function: object
    args: object


class _PersistentId(NamedTuple):
    """A BINPERSID opcode: torch.save's reference to a storage, ('storage', class, key, location, numel)."""

    pid: object


class TensorPickle(NamedTuple):
    """What the pickle of a torch.save record of one tensor says about it."""

    dtype: torch.dtype
    storage_key: str  # the storage's bytes are the zip entry `<name>/data/<storage_key>`
    storage_numel: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


_VALUE_OPS = {"BININT", "BININT1", "BININT2", "LONG1", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
_CONSTANTS = {"NEWFALSE": False, "NEWTRUE": True, "NONE": None}
_TUPLE_SIZES = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_REBUILD_TENSOR = _Global(PICKLED_TENSOR.module, PICKLED_TENSOR.path)
_ORDERED_DICT = _Global("collections", "OrderedDict")


def _pickled_value(data: bytes) -> object | None:
    """The value a pickle of plain tuples, numbers, strings, globals, persistent ids and calls describes, with
    globals and calls left as descriptions (nothing imported, nothing called); None for any other opcode or a
    malformed pickle."""
    stack: list[object] = []
    marks: list[int] = []
    memo: dict[int, object] = {}
    try:
        for opcode, arg, _ in pickletools.genops(data):
            name = opcode.name
            if name in _VALUE_OPS:
                stack.append(arg)
            elif name in _CONSTANTS:
                stack.append(_CONSTANTS[name])
            elif name == "GLOBAL":
                module, _, qualified = str(arg).partition(" ")
                stack.append(_Global(module, qualified))
            elif name == "MARK":
                marks.append(len(stack))
            elif name == "TUPLE" or name in _TUPLE_SIZES:
                start = marks.pop() if name == "TUPLE" else len(stack) - _TUPLE_SIZES[name]
                if start < 0:
                    return None
                items = tuple(stack[start:])
                del stack[start:]
                stack.append(items)
            elif name in ("BINPUT", "LONG_BINPUT", "MEMOIZE"):
                memo[len(memo) if name == "MEMOIZE" else _memo_key(arg)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET"):
                stack.append(memo[_memo_key(arg)])
            elif name == "BINPERSID":
                stack.append(_PersistentId(stack.pop()))
            elif name == "REDUCE":
                args = stack.pop()
                stack.append(_Call(stack.pop(), args))
            elif name == "STOP":
                return stack[0] if len(stack) == 1 and not marks else None
            elif name != "PROTO":
                return None
    except (ValueError, IndexError, KeyError):  # a truncated or malformed pickle: not one we read ourselves
        return None
    return None


def _memo_key(arg: object) -> int:
    if not isinstance(arg, int):
        raise ValueError(f"memo index {arg!r}")
    return arg


def tensor_pickle(data: bytes) -> TensorPickle | None:
    """What `data` (a record's data.pkl, possibly followed by other bytes) says about the one tensor it holds,
    if it is torch.save's pickle of a plain tensor (`_rebuild_tensor_v2(storage, offset, shape, stride, False,
    OrderedDict())`) of a dtype in STORAGE_DTYPES; None for anything else."""
    value = _pickled_value(data)
    if not isinstance(value, _Call) or value.function != _REBUILD_TENSOR:
        return None
    if not isinstance(value.args, tuple) or len(value.args) != 6:
        return None
    storage, offset, shape, stride, requires_grad, hooks = value.args
    if requires_grad is not False or hooks != _Call(_ORDERED_DICT, ()) or not isinstance(storage, _PersistentId):
        return None
    pid = storage.pid
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Global)):
        return None
    _, storage_class, key, _, numel = pid
    dtype = STORAGE_DTYPES.get(storage_class.name) if storage_class.module == "torch" else None
    ints = (offset, numel, *shape, *stride) if isinstance(shape, tuple) and isinstance(stride, tuple) else ()
    if dtype is None or not isinstance(key, str) or not ints or not all(type(n) is int for n in ints):
        return None
    return TensorPickle(dtype, key, numel, offset, shape, stride)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _local_headers(head: bytes) -> list[tuple[int, str, int, int]]:
    """(offset of the header, entry name, compression method, offset of the entry's bytes) of each zip local
    file header found in `head`, in order (a header that does not fit in `head` is left out)."""
    found, start = [], head.find(b"PK\x03\x04")
    while 0 <= start <= len(head) - LOCAL_HEADER.size:
        fields = LOCAL_HEADER.unpack_from(head, start)
        method, name_length, extra_length = fields[3], fields[9], fields[10]
        name_end = start + LOCAL_HEADER.size + name_length
        if fields[0] == LOCAL_SIGNATURE and name_end <= len(head):
            name = head[start + LOCAL_HEADER.size : name_end].decode("utf-8", "replace")
            found.append((start, name, method, name_end + extra_length))
        start = head.find(b"PK\x03\x04", start + 1)
    return found


def locate_tensor_data(head: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> int | None:
    """Where, from the start of a torch.save record whose first bytes are `head`, the raw bytes of its tensor
    begin, if the record is one contiguous tensor of `dtype` and `shape` whose storage is exactly its bytes
    (offset 0, stored uncompressed, little-endian): its first entry is the pickle saying so and the entry of
    that storage begins in `head`. None for any other record (the caller deserialises it with torch.load)."""
    headers = _local_headers(head)
    if not headers or headers[0][0] != 0 or not headers[0][1].endswith("/data.pkl") or headers[0][2] != 0:
        return None
    prefix = headers[0][1][: -len("data.pkl")]
    described = tensor_pickle(head[headers[0][3] :])
    if (
        described is None
        or described.dtype != dtype
        or described.shape != tuple(shape)
        or described.stride != contiguous_strides(described.shape)
        or described.storage_offset != 0
        or described.storage_numel != math.prod(shape)
        or sys.byteorder != "little"
    ):
        return None
    data_start = None
    for _, name, method, start in headers[1:]:
        if name == f"{prefix}byteorder" and head[start : start + len("little")] != b"little":
            return None  # written on a big-endian machine: torch.load swaps the bytes
        if name == f"{prefix}data/{described.storage_key}" and method == 0:
            data_start = start
    return data_start


def descriptor_matches(after_data: bytes, size: int) -> bool:
    """The bytes following an entry's data are torch's zip data descriptor for `size` bytes (its CRC-32, then
    the compressed and uncompressed sizes: 4 bytes each, or 8 for zip64)."""
    if after_data[:4] != DESCRIPTOR_SIGNATURE:
        return False
    short = struct.unpack_from("<II", after_data, 8) if len(after_data) >= 16 else None
    wide = struct.unpack_from("<QQ", after_data, 8) if len(after_data) >= 24 else None
    return short == (size, size) or wide == (size, size)
