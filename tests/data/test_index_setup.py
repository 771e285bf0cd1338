"""Index building that is bounded and leaves nothing behind: the size check, chunked building and writing,
stale temporaries, file modes under the umask, and Megatron's separate split paths."""

import os
import socket

import numpy as np
import pytest

from data import gpt_dataset, index_budget
from data.atomic_files import atomic_output, process_umask, temporary_path
from data.builder import build_split_datasets, build_train_valid_test_datasets
from data.gpt_dataset import GPTDataset, build_sample_index, save_atomic
from data.indexed_dataset import IndexedDataset
from tests.data.options import BUILD, SAMPLES
from tests.data.test_gpt_dataset import make_dataset

pytestmark = pytest.mark.tier("fast")


@pytest.fixture
def umask_027():
    """Run with umask 027 (group may read, others nothing), restored after."""
    previous = os.umask(0o027)
    yield
    os.umask(previous)


def test_chunked_sample_index_equals_one_pass(monkeypatch):
    rng = np.random.RandomState(3)
    sizes = rng.randint(0, 40, size=50).astype(np.int32)
    document_index = np.tile(np.arange(50, dtype=np.int32), 4)
    rng.shuffle(document_index)
    for extra in (True, False):
        total = (int(sizes.sum()) * 4 - int(extra)) // 16
        whole = build_sample_index(sizes, document_index, 16, total, extra)
        monkeypatch.setattr(gpt_dataset, "_CHUNK", 7)  # many chunks, one of them partial
        chunked = build_sample_index(sizes, document_index, 16, total, extra)
        monkeypatch.setattr(gpt_dataset, "_CHUNK", 1 << 22)
        np.testing.assert_array_equal(chunked, whole)


def test_index_cache_files_follow_the_umask(tmp_path, umask_027):
    assert process_umask() == 0o027
    prefix = make_dataset(tmp_path / "d", [30, 50, 20, 70])
    cache = tmp_path / "cache"
    GPTDataset(IndexedDataset(prefix), "train", (0, 4), 8, 1, 40, str(cache), SAMPLES)
    modes = {name: os.stat(cache / name).st_mode & 0o777 for name in os.listdir(cache)}
    assert len(modes) == 4 and set(modes.values()) == {0o640}, modes  # mkstemp would give 0o600
    save_atomic(str(tmp_path / "big.npy"), np.arange(100_000).reshape(-1, 2))
    assert os.stat(tmp_path / "big.npy").st_mode & 0o777 == 0o640


def test_an_interrupted_write_leaves_no_temporary(tmp_path):
    target = tmp_path / "x.npy"
    with pytest.raises(KeyboardInterrupt), atomic_output(str(target)) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(b"partial")
        raise KeyboardInterrupt  # what a stop signal raises during setup (operations/preemption.stop_at_once)
    assert os.listdir(tmp_path) == []


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    prefix = make_dataset(tmp_path / "d", [30, 50, 20, 70])
    cache = tmp_path / "cache"
    cache.mkdir()
    dead = cache / f"abc-GPTDataset-sample_index.npy.tmp-{socket.gethostname()}-{2**22 + 12345}"
    other_host = cache / "abc-GPTDataset-sample_index.npy.tmp-some-other-host-1"
    live = cache / os.path.basename(temporary_path("abc-GPTDataset-shuffle_index.npy"))
    for path in (dead, other_host, live):
        path.write_bytes(b"x" * 100)
    GPTDataset(IndexedDataset(prefix), "train", (0, 4), 8, 1, 40, str(cache), SAMPLES)
    assert not dead.exists()  # a kill -9 of an earlier build on this host
    assert other_host.exists() and live.exists()  # maybe still being written


def test_an_index_too_large_for_the_disk_is_refused_before_building(tmp_path, monkeypatch):
    prefix = make_dataset(tmp_path / "d", [30, 50, 20, 70])
    cache = tmp_path / "cache"
    monkeypatch.setattr(index_budget, "free_disk_bytes", lambda folder: 10_000)
    with pytest.raises(ValueError) as error:
        GPTDataset(IndexedDataset(prefix), "train", (0, 4), 8, 1, 100_000, str(cache), SAMPLES)
    message = str(error.value)
    assert "\n" not in message and prefix in message and "train split" in message
    # ceil(800,001 / 170) = 4,706 epochs, (4,706 * 170 - 1) // 8 = 100,002 samples: 4 * 18,824 + 16 * 100,003 + 4 * 100,002 bytes
    assert "its index would take 2.0 MiB (100,002 samples of 8 tokens: 4,706 epoch(s) of 170 tokens)" in message
    assert "9.8 KiB free on the disk of" in message and "data.cache_dir" in message
    assert not cache.exists()  # nothing built, nothing written


def test_an_index_too_large_for_memory_is_refused(tmp_path, monkeypatch):
    prefix = make_dataset(tmp_path / "d", [30, 50, 20, 70])
    monkeypatch.setattr(index_budget, "available_memory_bytes", lambda: 50_000)
    with pytest.raises(ValueError, match=r"more than half of the 48\.8 KiB memory available"):
        GPTDataset(IndexedDataset(prefix), "train", (0, 4), 8, 1, 100_000, None, SAMPLES)


def test_separate_split_paths_use_every_document_of_their_prefix(tmp_path):
    train_prefix = make_dataset(tmp_path / "a", [30, 50, 20, 70], seed=1)
    valid_prefix = make_dataset(tmp_path / "b", [40, 10, 25], seed=2)
    cache = str(tmp_path / "cache")
    train, valid, test = build_split_datasets(([train_prefix], [valid_prefix], []), 8, 1, (20, 6, 0), cache, BUILD)
    assert test is None
    assert train.description["document_range"] == [0, 4] and train.description["split"] == "train"
    assert valid.description["document_range"] == [0, 3] and valid.description["split"] == "valid"
    assert valid.indexed.path_prefix == valid_prefix
    # The train split equals data_path=[a] with all of it given to train.
    alone = build_train_valid_test_datasets([train_prefix], "1,0,0", 8, 1, (20, 0, 0), cache, BUILD)[0]
    assert [list(train[i]["text"]) for i in range(len(train))] == [list(alone[i]["text"]) for i in range(len(alone))]
    weighted = build_split_datasets(([0.5, train_prefix, 0.5, valid_prefix], [], []), 8, 1, (20, 0, 0), cache, BUILD)
    assert len(weighted[0]) == 20 and weighted[1] is None


def test_preprocessed_files_follow_the_umask(tok_files, tmp_path, umask_027):
    from tests.data.helpers import VARIED_TEXTS, run_preprocess, write_jsonl

    prefix = run_preprocess(tok_files, write_jsonl(tmp_path / "c.jsonl", VARIED_TEXTS), str(tmp_path / "out"))
    for suffix in (".bin", ".idx"):
        assert os.stat(prefix + suffix).st_mode & 0o777 == 0o640
