"""GPT samples against a slow, obviously-correct reference of the rules; splits, caches, blending."""

import os

import numpy as np
import pytest

from data.blend_index import build_blending_indices
from data.blended_dataset import BlendedDataset
from data.builder import build_train_valid_test_datasets, split_document_ranges
from data.gpt_dataset import GPTDataset, build_indices
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.data.options import BUILD, SAMPLES

pytestmark = pytest.mark.tier("fast")


def make_dataset(path, lengths, seed=0):
    """Documents of the given lengths with distinct random tokens; returns the prefix."""
    rng = np.random.RandomState(seed)
    builder = IndexedDatasetBuilder(str(path) + ".bin", np.uint16)
    for n in lengths:
        builder.add_document(rng.randint(0, 60000, size=n))
    builder.finalize(str(path) + ".idx")
    return str(path)


def reference_samples(ds, documents, seq_length, num_samples, seed):
    """The rules as written: epochs, one RandomState, shuffled documents, a flat token stream."""
    sizes = [len(ds[d]) for d in documents]
    tokens = sum(sizes)
    epochs = 1
    while epochs * tokens < num_samples * seq_length + 1:
        epochs += 1
    total = (epochs * tokens - 1) // seq_length
    before_final = ((epochs - 1) * tokens - 1) // seq_length
    per_epoch = (tokens - 1) // seq_length
    separate = epochs > 1 and num_samples - before_final < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)
    if separate:
        first = np.array(list(documents) * (epochs - 1), dtype=np.int32)
        rng.shuffle(first)
        last = np.array(list(documents), dtype=np.int32)
        rng.shuffle(last)
        doc_order = list(first) + list(last)
    else:
        doc_order = np.array(list(documents) * epochs, dtype=np.int32)
        rng.shuffle(doc_order)
    stream = []
    for d in doc_order:
        stream.extend(ds[int(d)].tolist())
    if separate:
        a, b = np.arange(before_final, dtype=np.uint32), np.arange(before_final, total, dtype=np.uint32)
        rng.shuffle(a)
        rng.shuffle(b)
        order = list(a) + list(b)
    else:
        order = np.arange(total, dtype=np.uint32)
        rng.shuffle(order)
    return [stream[j * seq_length : j * seq_length + seq_length + 1] for j in map(int, order)]


def megatron_loop_sample_index(sizes, doc_idx, seq_length, num_samples):
    """Megatron's compiled build_sample_idx loop, transcribed."""
    rows = [(0, 0)]
    doc_idx_index, doc_offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = int(sizes[doc_idx[doc_idx_index]]) - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        rows.append((doc_idx_index, doc_offset))
    return np.array(rows)


LENGTHS = [5, 1, 17, 0, 3, 40, 2, 9, 0, 11, 6, 1, 25, 4]


@pytest.mark.parametrize("seq_length,num_samples", [(7, 3), (7, 18), (4, 100), (16, 20), (3, 130), (1, 50)])
def test_samples_equal_reference(tmp_path, seq_length, num_samples):
    prefix = make_dataset(tmp_path / "d", LENGTHS)
    ds = IndexedDataset(prefix)
    doc_range = (2, 13)
    gpt = GPTDataset(ds, "train", doc_range, seq_length, 1234, num_samples, None, SAMPLES)
    expected = reference_samples(ds, range(*doc_range), seq_length, num_samples, 1234)
    assert len(gpt) == len(expected) >= num_samples
    for i in range(len(gpt)):
        sample = gpt[i]["text"]
        assert sample.dtype == np.int64 and len(sample) == seq_length + 1
        assert sample.tolist() == expected[i], i
    loop = megatron_loop_sample_index(ds.sequence_lengths, gpt.document_index, seq_length, len(gpt))
    np.testing.assert_array_equal(gpt.sample_index, loop)


def test_separate_final_epoch_case_is_exercised():
    sizes = np.full(10, 10, dtype=np.int32)
    docs = np.arange(10, dtype=np.int32)
    # 100 tokens/epoch, seq 9 -> 11 samples/epoch; 23 samples need 3 epochs; final epoch gives 1 < 8.
    doc_index, _, shuffle = build_indices(sizes, docs, 9, 23, 0, SAMPLES)
    assert sorted(doc_index[20:].tolist()) == list(range(10))  # the last epoch shuffled on its own
    assert sorted(shuffle[:22].tolist()) == list(range(22))


def test_split_ranges_follow_megatron_rounding():
    assert split_document_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges("1,0,0", 10) == [(0, 10), None, None]
    assert split_document_ranges("98,2", 10) == [(0, 10), None, None]  # round(9.8) = 10: empty valid


def test_builder_splits_caches_and_none(tmp_path):
    prefix = make_dataset(tmp_path / "corpus", [30] * 20)
    train, valid, test = build_train_valid_test_datasets([prefix], "80,20,0", 8, 5, (40, 3, 2), None, BUILD)
    assert test is None and len(train) >= 40 and len(valid) >= 3
    cache = tmp_path / "index-cache"
    files = sorted(os.listdir(cache))
    assert len(files) == 8 and not [f for f in files if "tmp" in f]
    again = build_train_valid_test_datasets([prefix], "80,20,0", 8, 5, (40, 3, 0), str(cache), BUILD)
    assert isinstance(again[0].shuffle_index, np.memmap)
    assert all(np.array_equal(train[i]["text"], again[0][i]["text"]) for i in range(len(train)))
    assert again[2] is None


def test_unwritable_cache_dir_still_builds(tmp_path):
    prefix = make_dataset(tmp_path / "corpus", [30] * 20)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder would go")
    train, _, _ = build_train_valid_test_datasets([prefix], "1", 8, 5, (10, 0, 0), str(blocker / "cache"), BUILD)
    assert len(train) >= 10


def test_blending_indices_follow_weights_and_rule():
    weights = [0.5, 0.3, 0.2]
    index, sample = build_blending_indices(weights, 1000)
    counts = [0, 0, 0]
    for i in range(1000):  # the rule, written out
        errors = [w * max(i, 1) - c for w, c in zip(weights, counts)]
        d = errors.index(max(errors))
        assert index[i] == d and sample[i] == counts[d]
        counts[d] += 1
    assert counts == [500, 300, 200]


def test_blended_builder_is_deterministic_and_proportional(tmp_path):
    a = make_dataset(tmp_path / "a", [50] * 10, seed=1)
    b = make_dataset(tmp_path / "b", [20] * 30, seed=2)
    args = (["0.7", a, 0.3, b], "1,0,0", 16, 9, (200, 0, 0), str(tmp_path / "cache"), BUILD)
    first, second = build_train_valid_test_datasets(*args), build_train_valid_test_datasets(*args)
    blend = first[0]
    assert isinstance(blend, BlendedDataset) and len(blend) == 200 and first[1] is None
    assert abs(int((blend.dataset_index == 0).sum()) - 140) <= 1
    for i in range(len(blend)):
        d, j = int(blend.dataset_index[i]), int(blend.dataset_sample_index[i])
        assert np.array_equal(blend[i]["text"], blend.datasets[d][j]["text"])
        assert np.array_equal(blend[i]["text"], second[0][i]["text"])
    assert len(blend.datasets[0]) >= int(np.ceil(np.ceil(200 * 0.7) * 1.005))
    assert isinstance(second[0].dataset_index, np.memmap)  # the second build reused the cache


@pytest.mark.parametrize("damage", ["object-array", "cut", "wrong-length"])
def test_a_damaged_index_cache_is_named_and_rebuilt(tmp_path, caplog, damage):
    """Before: a damaged blend cache file gave numpy's "Array can't be memory-mapped: Python objects in dtype"
    with no file named, every start, until someone deleted it."""
    a = make_dataset(tmp_path / "a", [50] * 10, seed=1)
    b = make_dataset(tmp_path / "b", [20] * 30, seed=2)
    cache = tmp_path / "cache"
    args = (["0.7", a, 0.3, b], "1,0,0", 16, 9, (200, 0, 0), str(cache), BUILD)
    first = build_train_valid_test_datasets(*args)[0]
    damaged = [str(cache / name) for name in os.listdir(cache) if name.endswith("BlendedDataset-dataset_index.npy")]
    shuffle = [str(cache / name) for name in os.listdir(cache) if name.endswith("GPTDataset-shuffle_index.npy")]
    # a GPTDataset cache's lengths are known only once built: its wrong-length file is not caught (the blend's is)
    for path in (damaged[0], shuffle[0]) if damage != "wrong-length" else damaged:
        if damage == "object-array":
            np.save(path, np.array([object()], dtype=object), allow_pickle=True)
        elif damage == "cut":
            with open(path, "r+b") as handle:
                handle.truncate(40)
        else:
            np.save(path, np.arange(3))
    with caplog.at_level("WARNING"):
        again = build_train_valid_test_datasets(*args)[0]
    named = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert any(damaged[0] in m and "rebuilding it" in m for m in named), named
    assert damage == "wrong-length" or any(shuffle[0] in m for m in named), named
    assert np.array_equal(np.asarray(again.dataset_index), np.asarray(first.dataset_index))
    assert all(np.array_equal(first[i]["text"], again[i]["text"]) for i in range(len(first)))
    assert np.load(damaged[0], mmap_mode="r").dtype.kind in "iu"  # rewritten whole
