"""One-line errors for malformed indexes, empty datasets / splits / blend components, vocabulary sizes."""

import struct
import types

import numpy as np
import pytest

from data.builder import build_train_valid_test_datasets
from data.indexed_dataset import HEADER_SIZE, IndexedDataset, IndexedDatasetError, write_index
from operations.startup import check_vocab_size
from tests.data.options import BUILD
from tests.data.test_gpt_dataset import make_dataset

pytestmark = pytest.mark.tier("fast")


def _patch(path, offset, fmt, value):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


def test_negative_length_names_file_and_sequence(tmp_path):
    prefix = make_dataset(tmp_path / "d", [3, 4, 5])
    _patch(prefix + ".idx", HEADER_SIZE + 4, "<i", -4)
    with pytest.raises(IndexedDatasetError, match=r"d.idx: sequence 1 has negative length -4"):
        IndexedDataset(prefix)


def test_pointer_disagreeing_with_lengths_names_sequence(tmp_path):
    prefix = make_dataset(tmp_path / "d", [3, 4, 5])
    _patch(prefix + ".idx", HEADER_SIZE + 3 * 4 + 2 * 8, "<q", 6)  # pointer of sequence 2 (should be 14)
    with pytest.raises(IndexedDatasetError, match=r"d.idx: sequence 2 has pointer 6, the lengths before it give 14"):
        IndexedDataset(prefix)


def test_bad_document_indices(tmp_path):
    prefix = str(tmp_path / "d")
    open(prefix + ".bin", "wb").write(np.zeros(12, np.uint16).tobytes())
    write_index(prefix + ".idx", np.uint16, [3, 4, 5], [0, 2, 1, 3])
    with pytest.raises(IndexedDatasetError, match="document 1 ends before it starts"):
        IndexedDataset(prefix)
    write_index(prefix + ".idx", np.uint16, [3, 4, 5], [0, 2])
    with pytest.raises(IndexedDatasetError, match="must run from 0 to 3 sequences"):
        IndexedDataset(prefix)


def test_validation_is_fast_on_large_indexes(tmp_path):
    prefix = str(tmp_path / "big")
    lengths = np.full(3_000_000, 7, dtype=np.int32)
    write_index(prefix + ".idx", np.uint16, lengths, np.arange(len(lengths) + 1))
    open(prefix + ".bin", "wb").truncate(int(lengths.sum()) * 2)
    assert len(IndexedDataset(prefix)) == 3_000_000


def test_empty_dataset_and_empty_split_are_one_line_errors(tmp_path):
    empty = make_dataset(tmp_path / "empty", [])
    with pytest.raises(ValueError, match=r"empty: the dataset holds no documents"):
        build_train_valid_test_datasets([empty], "1", 8, 1, (10, 0, 0), None, BUILD)
    small = make_dataset(tmp_path / "small", [20] * 10)
    with pytest.raises(
        ValueError,
        match=r"small: the valid split is empty: split '98,2,0' gives it documents "
        r"\[10, 10\) of 10",
    ):
        build_train_valid_test_datasets([small], "98,2,0", 8, 1, (10, 5, 0), None, BUILD)
    zero_tokens = make_dataset(tmp_path / "zero", [0, 0, 5])
    with pytest.raises(ValueError, match=r"zero: train split has 2 documents and no tokens"):
        build_train_valid_test_datasets([zero_tokens], "2,1", 8, 1, (10, 0, 0), None, BUILD)
    with pytest.raises(ValueError, match=r"small: the valid split is empty"):  # an empty blend component
        build_train_valid_test_datasets(
            [0.5, make_dataset(tmp_path / "big", [20] * 100), 0.5, small], "98,2,0", 8, 1, (10, 5, 0), None, BUILD
        )


def test_split_of_one_token_builds_as_in_megatron(tmp_path):
    prefix = make_dataset(tmp_path / "one", [1, 30])
    train, _, _ = build_train_valid_test_datasets([prefix], "1,1", 4, 1, (6, 0, 0), None, BUILD)
    assert len(train) == 6 and all(len(set(train[i]["text"].tolist())) == 1 for i in range(6))


def test_model_vocab_smaller_than_tokenizer_is_one_line_error():
    data = types.SimpleNamespace(vocab_file="v.json", tokenizer_model=None, tokenizer_type="GPT2BPETokenizer")
    with pytest.raises(
        ValueError,
        match=r"model.vocab_size=100 is smaller than the tokenizer's vocabulary "
        r"\(257 entries in v.json\)",
    ):
        check_vocab_size(100, 257, data)
    check_vocab_size(257, 257, data)
