"""GPT samples of seq_length + 1 tokens with Megatron's rules (see DATA_FORMATS.md, "GPT samples").

The three index arrays (document, sample, shuffle) are built with numpy only: the sample index, which
Megatron builds with a compiled loop, is a searchsorted over cumulative document lengths here, because
sample k starts at token k * seq_length of the shuffled-document stream.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile

import numpy as np

from data.indexed_dataset import IndexedDataset

_CACHE_FORMAT = 1  # bump when the index layout changes, so stale caches are not reused


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest E with E * tokens_per_epoch >= num_samples * seq_length + 1."""
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def separate_final_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int, num_epochs: int) -> bool:
    """Megatron's rule: shuffle the last epoch apart when it contributes under 80% of an epoch."""
    if num_epochs == 1:
        return False
    before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return num_samples - before_final < int(0.80 * per_epoch)


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final: bool) -> np.ndarray:
    """The split's document ids repeated num_epochs times and shuffled (last epoch apart if asked)."""
    if not separate_final or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_samples: int) -> np.ndarray:
    """Rows (position in document_index, offset) where each sample starts; row k+1 is where sample k ends.

    Sample k spans stream tokens [k*s, (k+1)*s] inclusive (s = seq_length; one token shared with the next).
    An end at a document's last token stays in that document, as in Megatron's loop, which is what
    searchsorted(side="right") - 1 gives, empty documents included.
    """
    doc_lengths = sizes[document_index].astype(np.int64)
    starts = np.zeros(len(doc_lengths) + 1, dtype=np.int64)
    np.cumsum(doc_lengths, out=starts[1:])
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    rows = np.searchsorted(starts, positions, side="right") - 1
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int64)
    sample_index[:, 0] = rows
    sample_index[:, 1] = positions - starts[rows]
    sample_index[0] = (0, 0)  # Megatron's first row, even if the first document is empty
    return sample_index


def build_shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """Shuffled arange(num_samples), then (if total > num_samples) shuffled arange(num_samples, total)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_indices(sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int,
                  seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) for the split's `documents` (ids into `sizes`)."""
    tokens_per_epoch = int(sizes[documents].astype(np.int64).sum())
    if tokens_per_epoch < 2:
        raise ValueError(f"split has {tokens_per_epoch} tokens; a sample needs at least 2")
    epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate = separate_final_epoch(tokens_per_epoch, seq_length, num_samples, epochs)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, epochs, rng, separate)
    total = (epochs * tokens_per_epoch - 1) // seq_length
    sample_index = build_sample_index(sizes, document_index, seq_length, total)
    before_final = ((epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else total
    shuffle_index = build_shuffle_index(before_final, total, rng)
    return document_index, sample_index, shuffle_index


def save_atomic(path: str, array: np.ndarray) -> None:
    """np.save to a temporary file in the same folder, then rename: readers never see a partial file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".npy.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class GPTDataset:
    """Samples of seq_length + 1 tokens from documents [begin, end) of an IndexedDataset.

    `__getitem__(i)` returns {"text": int64 array of seq_length + 1}; len() is the number of samples built
    (at least num_samples). Index arrays are cached as .npy under cache_dir (keyed by an MD5 of the
    description) and memory-mapped when present.
    """

    def __init__(self, indexed: IndexedDataset, split_name: str, document_range: tuple[int, int],
                 seq_length: int, seed: int, num_samples: int, cache_dir: str | None):
        self.indexed = indexed
        self.seq_length = seq_length
        documents = np.arange(*document_range, dtype=np.int32)
        sizes = indexed.sequence_lengths
        self.description = dict(
            cache_format=_CACHE_FORMAT, class_name="GPTDataset",
            path_prefix=os.path.abspath(indexed.path_prefix),
            split=split_name, document_range=list(document_range), seq_length=seq_length, seed=seed,
            num_samples=num_samples, tokens_in_split=int(sizes[documents].astype(np.int64).sum()))
        self.cache_key = hashlib.md5(json.dumps(self.description, sort_keys=True).encode()).hexdigest()
        arrays = self._load_cache(cache_dir)
        if arrays is None:
            arrays = build_indices(sizes, documents, seq_length, num_samples, seed)
            if cache_dir is not None:
                try:
                    self._save_cache(cache_dir, arrays)
                except OSError as exc:  # e.g. read-only data folder: train on, rebuild next time
                    logging.getLogger(__name__).warning(
                        "index cache not written to %s (%s); indices kept in memory", cache_dir, exc)
        self.document_index, self.sample_index, self.shuffle_index = arrays

    def _cache_paths(self, cache_dir: str) -> list[str]:
        return [os.path.join(cache_dir, f"{self.cache_key}-GPTDataset-{name}.npy")
                for name in ("document_index", "sample_index", "shuffle_index")]

    def _load_cache(self, cache_dir: str | None):
        if cache_dir is None:
            return None
        paths = self._cache_paths(cache_dir)
        if not all(os.path.exists(p) for p in paths):
            return None
        return tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)

    def _save_cache(self, cache_dir: str, arrays) -> None:
        os.makedirs(cache_dir, exist_ok=True)
        description_path = os.path.join(cache_dir, f"{self.cache_key}-GPTDataset-description.txt")
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".txt.tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.description, f, indent=2, sort_keys=True)
        os.replace(tmp, description_path)
        # The shuffle index is written last: its presence is what makes a cache complete, see _load_cache.
        for path, array in zip(self._cache_paths(cache_dir), arrays):
            save_atomic(path, array)

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def __getitem__(self, i: int) -> dict:
        j = int(self.shuffle_index[i])
        doc_beg, off_beg = (int(x) for x in self.sample_index[j])
        doc_end, off_end = (int(x) for x in self.sample_index[j + 1])
        get, docs = self.indexed.get, self.document_index
        if doc_beg == doc_end:
            tokens = get(int(docs[doc_beg]), offset=off_beg, length=off_end - off_beg + 1)
        else:
            parts = [get(int(docs[doc_beg]), offset=off_beg)]
            parts += [get(int(docs[k])) for k in range(doc_beg + 1, doc_end)]
            parts.append(get(int(docs[doc_end]), length=off_end + 1))
            tokens = np.concatenate(parts)
        return {"text": np.asarray(tokens, dtype=np.int64)}
