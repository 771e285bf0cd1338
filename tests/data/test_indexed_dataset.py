"""MMIDIDX v1 byte for byte against an independent reader/writer written from DATA_FORMATS.md."""

import struct

import numpy as np
import pytest

from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, merge_datasets

pytestmark = pytest.mark.tier("fast")

CODES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}


def independent_read(prefix):
    """Parse .idx field by field with struct, as the format page says; return header + arrays + seqs."""
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    code = raw[17]
    n, docs = struct.unpack_from("<QQ", raw, 18)
    off = 34
    lengths = list(struct.unpack_from(f"<{n}i", raw, off))
    off += 4 * n
    pointers = list(struct.unpack_from(f"<{n}q", raw, off))
    off += 8 * n
    doc_idx = list(struct.unpack_from(f"<{docs}q", raw, off))
    off += 8 * docs
    assert off == len(raw), "trailing bytes in .idx"
    data = open(prefix + ".bin", "rb").read()
    itemsize = np.dtype(CODES[code]).itemsize
    seqs = [np.frombuffer(data, CODES[code], count=ln, offset=p).tolist() for ln, p in zip(lengths, pointers)]
    return dict(
        version=version,
        code=code,
        lengths=lengths,
        pointers=pointers,
        doc_idx=doc_idx,
        seqs=seqs,
        itemsize=itemsize,
        bin_size=len(data),
    )


def independent_write(prefix, seqs, code, doc_idx=None):
    """Write .bin/.idx with struct only."""
    fmt = CODES[code]
    itemsize = np.dtype(fmt).itemsize
    doc_idx = list(range(len(seqs) + 1)) if doc_idx is None else doc_idx
    pointers, pos = [], 0
    for s in seqs:
        pointers.append(pos)
        pos += len(s) * itemsize
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, dtype=fmt).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([code]))
        f.write(struct.pack("<QQ", len(seqs), len(doc_idx)))
        f.write(struct.pack(f"<{len(seqs)}i", *[len(s) for s in seqs]))
        f.write(struct.pack(f"<{len(seqs)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


SEQS = [[1, 2, 3], [65000, 0], [7] * 10, [], [42]]


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.int64, 5), (np.uint8, 1)])
def test_written_files_parse_field_by_field(tmp_path, dtype, code):
    prefix = str(tmp_path / "ds")
    seqs = [[x % 250 for x in s] if code == 1 else s for s in SEQS]
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for s in seqs:
        builder.add_document(s)
    builder.finalize(prefix + ".idx")
    got = independent_read(prefix)
    assert got["version"] == 1 and got["code"] == code
    assert got["lengths"] == [len(s) for s in seqs]
    assert got["pointers"] == list(np.cumsum([0] + [len(s) * got["itemsize"] for s in seqs[:-1]]))
    assert got["doc_idx"] == list(range(len(seqs) + 1))
    assert got["seqs"] == seqs
    assert got["bin_size"] == sum(map(len, seqs)) * got["itemsize"]


@pytest.mark.parametrize("code", [8, 4])
def test_independently_written_files_read_back(tmp_path, code):
    prefix = str(tmp_path / "ext")
    independent_write(prefix, SEQS, code, doc_idx=[0, 2, 5])
    ds = IndexedDataset(prefix)
    assert len(ds) == len(SEQS)
    assert [ds[i].tolist() for i in range(len(ds))] == SEQS
    assert ds.document_indices.tolist() == [0, 2, 5]
    assert ds.dtype == np.dtype(CODES[code])
    assert ds.get(2, offset=3, length=4).tolist() == [7] * 4


def test_pickles_by_path(tmp_path):
    import pickle

    prefix = str(tmp_path / "p")
    independent_write(prefix, SEQS, 8)
    ds = IndexedDataset(prefix)
    assert len(pickle.dumps(ds)) < 200
    assert pickle.loads(pickle.dumps(ds))[2].tolist() == SEQS[2]


def test_merge_appends_offset_document_indices(tmp_path):
    a, b, out = (str(tmp_path / n) for n in ("a", "b", "out"))
    independent_write(a, SEQS[:2], 8, doc_idx=[0, 2])
    independent_write(b, SEQS[2:], 8, doc_idx=[0, 1, 3])
    merge_datasets([a, b], out)
    got = independent_read(out)
    assert got["seqs"] == SEQS
    assert got["doc_idx"] == [0, 2, 3, 5]


def test_merge_rejects_mixed_dtypes(tmp_path):
    independent_write(str(tmp_path / "a"), SEQS, 8)
    independent_write(str(tmp_path / "b"), SEQS, 4)
    with pytest.raises(IndexedDatasetError, match="dtype"):
        merge_datasets([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "out"))
    assert not list(tmp_path.glob("out*"))


def _corrupt(tmp_path, mutate):
    prefix = str(tmp_path / "bad")
    independent_write(prefix, SEQS, 8)
    mutate(prefix)
    return prefix


def _patch(path, offset, data):
    raw = bytearray(open(path, "rb").read())
    raw[offset : offset + len(data)] = data
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda p: _patch(p + ".idx", 0, b"XXIDIDX"), "bad magic"),
        (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)), "unsupported version 2"),
        (lambda p: _patch(p + ".idx", 17, bytes([9])), "unknown dtype code 9"),
        (lambda p: open(p + ".idx", "r+b").truncate(60), "truncated"),
        (lambda p: open(p + ".idx", "r+b").truncate(20), "truncated header"),
        (lambda p: open(p + ".bin", "r+b").truncate(6), r"bytes, but .*bad.idx describes .* \(truncated\)"),
        (lambda p: open(p + ".bin", "ab").write(b"\0" * 64), "does not belong to this .idx"),
        (lambda p: open(p + ".idx", "ab").write(b"\0" * 8), "trailing bytes"),
    ],
)
def test_malformed_files_give_one_line_errors_naming_the_file(tmp_path, mutate, message):
    prefix = _corrupt(tmp_path, mutate)
    with pytest.raises(IndexedDatasetError, match=message) as info:
        IndexedDataset(prefix)
    text = str(info.value)
    assert "\n" not in text and "bad." in text
