"""Megatron's MMIDIDX v1 indexed dataset: PREFIX.idx (header + arrays) and PREFIX.bin (tokens).

Layout (little-endian), see DATA_FORMATS.md: magic b"MMIDIDX\\x00\\x00", version u64 = 1, dtype code u8,
sequence_count u64, document_count u64, then int32 lengths[N], int64 pointers[N], int64 document_indices.
"""

from __future__ import annotations

import os
import shutil
import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # = 34, where the arrays start
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A malformed .idx/.bin pair; the message names the file."""


def best_dtype(vocab_size: int) -> type:
    """Token dtype Megatron uses: uint16 below 65500 entries of vocabulary, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def idx_path(prefix: str) -> str:
    """The .idx file of `prefix`."""
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    """The .bin file of `prefix`."""
    return prefix + ".bin"


def write_index(path: str, dtype, lengths, document_indices) -> None:
    """Write an .idx file for sequences of `lengths` tokens (pointers derived) and `document_indices`."""
    lengths = np.asarray(lengths, dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    document_indices = np.asarray(document_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODE_OF_DTYPE[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(document_indices.astype("<i8").tobytes())


class IndexedDatasetBuilder:
    """Append sequences to PREFIX.bin while collecting the index; `finalize(idx_file)` writes the .idx.

    Writes go to the paths given; callers wanting atomic output pass temporary paths and rename.
    """

    def __init__(self, bin_file: str, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"{bin_file}: unsupported token dtype {self.dtype}")
        self._file = open(bin_file, "wb")  # noqa: SIM115 (closed by finalize / __exit__)
        self._path = bin_file
        self.lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, tokens) -> None:
        """Append one sequence."""
        array = np.asarray(tokens, dtype=self.dtype)
        self._file.write(array.tobytes(order="C"))
        self.lengths.append(array.size)

    def end_document(self) -> None:
        """Close the current document (Megatron: one sequence per document without sentence splitting)."""
        self.document_indices.append(len(self.lengths))

    def add_document(self, tokens) -> None:
        """Append one sequence forming one whole document."""
        self.add_item(tokens)
        self.end_document()

    def add_index(self, prefix: str) -> None:
        """Append every sequence and document of the dataset at `prefix` (same dtype required)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"{idx_path(prefix)}: dtype {other.dtype} differs from {self.dtype}")
        offset = len(self.lengths)
        self.lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((other.document_indices[1:] + offset).tolist())
        with open(bin_path(prefix), "rb") as f:
            shutil.copyfileobj(f, self._file, 1 << 24)
        del other

    def close(self) -> None:
        """Close the .bin file (idempotent); finalize() does it too."""
        if not self._file.closed:
            self._file.close()

    def finalize(self, idx_file: str) -> None:
        """Close the .bin and write the .idx."""
        self._file.close()
        write_index(idx_file, self.dtype, self.lengths, self.document_indices)


class IndexedDataset:
    """Memory-mapped reader: len(ds) = number of sequences, ds[i] = sequence i's tokens (numpy array)."""

    def __init__(self, path_prefix: str):
        self.path_prefix = path_prefix
        self._read_index(idx_path(path_prefix))
        data_path = bin_path(path_prefix)
        try:
            bin_size = os.path.getsize(data_path)
        except OSError as exc:
            raise IndexedDatasetError(f"{data_path}: cannot open: {exc.strerror}") from None
        needed = int(self.sequence_lengths.astype(np.int64).sum()) * self.dtype.itemsize
        if self.sequence_pointers.size:
            needed = max(needed, int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize)
        if bin_size != needed:  # longer is as wrong as shorter: the tokens of another dataset (or a torn copy)
            raise IndexedDatasetError(
                f"{data_path}: {bin_size} bytes, but {idx_path(path_prefix)} describes {needed} "
                f"({'truncated' if bin_size < needed else 'the .bin does not belong to this .idx'}): "
                f"copy both files of one dataset again, or re-run tools/preprocess_data.py"
            )
        # An empty file cannot be memory-mapped; an empty array stands in for it.
        self._bin = np.memmap(data_path, dtype=self.dtype, mode="r") if bin_size else np.zeros(0, dtype=self.dtype)

    def _read_index(self, path: str) -> None:
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                header = f.read(HEADER_SIZE)
        except OSError as exc:
            raise IndexedDatasetError(f"{path}: cannot open: {exc.strerror}") from None
        if len(header) < HEADER_SIZE:
            raise IndexedDatasetError(f"{path}: truncated header ({len(header)} of {HEADER_SIZE} bytes)")
        if header[:9] != MAGIC:
            raise IndexedDatasetError(f"{path}: bad magic {header[:9]!r} (not an MMIDIDX index)")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise IndexedDatasetError(f"{path}: unsupported version {version} (expected {VERSION})")
        code = header[17]
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        count, doc_count = struct.unpack("<QQ", header[18:34])
        expected = HEADER_SIZE + count * (4 + 8) + doc_count * 8
        if size != expected:
            problem = "truncated" if size < expected else "trailing bytes"
            raise IndexedDatasetError(f"{path}: {problem} ({size} bytes, its header says {expected})")
        mm = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        self._idx = mm
        self.sequence_lengths = np.frombuffer(mm, dtype="<i4", count=count, offset=HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(mm, dtype="<i8", count=count, offset=HEADER_SIZE + 4 * count)
        self.document_indices = np.frombuffer(mm, dtype="<i8", count=doc_count, offset=HEADER_SIZE + 12 * count)
        _validate_index(path, self.sequence_lengths, self.sequence_pointers, self.document_indices, self.dtype.itemsize)

    def __getstate__(self):
        # Pickle the path, not the mapped arrays (which would copy the whole corpus into the pickle).
        return self.path_prefix

    def __setstate__(self, path_prefix: str) -> None:
        IndexedDataset.__init__(self, path_prefix)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (a view of the memory map)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences in {self.path_prefix}")
        seq_len = int(self.sequence_lengths[i])
        if length is None:
            length = seq_len - offset
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self._bin[start : start + length]

    @property
    def document_count(self) -> int:
        """Number of documents (len(document_indices) - 1)."""
        return len(self.document_indices) - 1


def _validate_index(path: str, lengths: np.ndarray, pointers: np.ndarray, documents: np.ndarray, itemsize: int) -> None:
    """Lengths >= 0, pointers = running sum of lengths * itemsize, document indices from 0 to N, non-
    decreasing. Vectorised in chunks (a few passes over the arrays, bounded memory); names the first bad
    entry."""
    chunk = 1 << 24
    offset = 0  # byte offset of the next sequence, carried across chunks
    for start in range(0, len(lengths), chunk):
        part = lengths[start : start + chunk].astype(np.int64)
        bad = np.flatnonzero(part < 0)
        if bad.size:
            i = start + int(bad[0])
            raise IndexedDatasetError(f"{path}: sequence {i} has negative length {int(lengths[i])}")
        expected = offset + np.concatenate(([0], np.cumsum(part[:-1]))) * itemsize
        bad = np.flatnonzero(pointers[start : start + chunk] != expected)
        if bad.size:
            i = start + int(bad[0])
            raise IndexedDatasetError(
                f"{path}: sequence {i} has pointer {int(pointers[i])}, the lengths "
                f"before it give {int(expected[bad[0]])}"
            )
        offset = int(expected[-1]) + int(part[-1]) * itemsize
    if len(documents) == 0 or documents[0] != 0 or documents[-1] != len(lengths):
        ends = documents[[0, -1]].tolist() if len(documents) else []
        raise IndexedDatasetError(
            f"{path}: document indices must run from 0 to {len(lengths)} sequences, got first/last {ends}"
        )
    bad = np.flatnonzero(np.diff(documents) < 0)
    if bad.size:
        raise IndexedDatasetError(
            f"{path}: document {int(bad[0])} ends before it starts "
            f"(document indices {int(documents[bad[0]])} > {int(documents[bad[0] + 1])})"
        )


def merge_datasets(prefixes: list[str], output_prefix: str) -> None:
    """Merge datasets into `output_prefix` (Megatron's rule); written aside and renamed when complete."""
    if not prefixes:
        raise ValueError("no input prefixes to merge")
    dtype = IndexedDataset(prefixes[0]).dtype
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)  # as preprocess_data does
    tmp_bin, tmp_idx = bin_path(output_prefix) + ".tmp", idx_path(output_prefix) + ".tmp"
    builder = IndexedDatasetBuilder(tmp_bin, dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(tmp_idx)
        os.replace(tmp_bin, bin_path(output_prefix))
        os.replace(tmp_idx, idx_path(output_prefix))
    finally:
        builder.close()
        for path in (tmp_bin, tmp_idx):
            if os.path.exists(path):
                os.remove(path)
