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
from dataclasses import dataclass

import numpy as np

from data.atomic_files import atomic_output, remove_stale_temporaries
from data.index_budget import check_index_fits, index_nbytes
from data.indexed_dataset import IndexedDataset

_CACHE_FORMAT = 1  # bump when the index layout changes, so stale caches are not reused
_CHUNK = 1 << 22  # samples (rows) per step when building and writing the large arrays


@dataclass(frozen=True)
class SampleOptions:
    """Megatron's GPTDatasetConfig switches that change which samples are built.

    extra_token: samples of seq_length + 1 tokens (tokens = x[:-1], labels = x[1:]); False: exactly
    seq_length tokens, the last label being padding (add_extra_token_to_sequence).
    drop_last_partial: drop the last, shorter sample (always on for train/test; Megatron's
    drop_last_partial_validation_sequence decides it for the valid split). A kept partial sample is
    padded with PAD_ID, which the loader masks out of the loss.
    """

    extra_token: bool
    drop_last_partial: bool


# Megatron's GPTDatasetConfig defaults: the cache key names the options only when they differ from these, so
# caches written before the options existed stay valid. (The run's options come from the data section.)
UNKEYED_OPTIONS = SampleOptions(extra_token=True, drop_last_partial=True)
PAD_ID = -1  # Megatron's _PAD_TOKEN_ID when the tokenizer has no pad token


@dataclass(frozen=True)
class TokenSource:
    """Where one token of a sample was read from (`locate_token`): for messages that name the bad input."""

    path_prefix: str  # the .bin/.idx prefix
    document: int  # document index in that file
    offset: int  # token offset inside the document


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int | None, extra: int = 1) -> int:
    """Smallest E with E * tokens_per_epoch >= num_samples * seq_length + extra (1 when num_samples is None)."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + extra
    return max(1, -(-needed // tokens_per_epoch))


def separate_final_epoch(
    tokens_per_epoch: int, seq_length: int, num_samples: int | None, num_epochs: int, extra: int = 1
) -> bool:
    """Megatron's rule: shuffle the last epoch apart when it contributes under 80% of an epoch."""
    if num_epochs == 1 or num_samples is None:  # None builds exactly one epoch
        return False
    before_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    per_epoch = (tokens_per_epoch - extra) // seq_length
    return num_samples - before_final < int(0.80 * per_epoch)


def total_samples(tokens: int, seq_length: int, options: SampleOptions) -> int:
    """Samples in `tokens` tokens of stream; a kept partial sample is rounded up in float32, as the helper."""
    extra = int(options.extra_token)
    if options.drop_last_partial:
        return (tokens - extra) // seq_length
    return int(np.ceil(np.float32(np.float32(tokens - extra) / np.float32(seq_length))))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final: bool
) -> np.ndarray:
    """The split's document ids repeated num_epochs times and shuffled (last epoch apart if asked)."""
    if not separate_final or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int, extra_token: bool = True
) -> np.ndarray:
    """Rows (position in document_index, offset) where each sample starts; row k+1 is where sample k ends.

    Sample k spans stream tokens [k*s, (k+1)*s + extra) (s = seq_length; with the extra token one token is
    shared with the next sample). Megatron's loop stores the end as the position of the last token read,
    plus one without the extra token; an end at a document's last token stays in that document, which is
    what searchsorted(side="right") - 1 gives, empty documents included. A partial last sample (kept
    only on request) ends where Megatron's loop stops: the last document, its length - extra.
    """
    extra = int(extra_token)
    doc_lengths = sizes[document_index].astype(np.int64)
    starts = np.zeros(len(doc_lengths) + 1, dtype=np.int64)
    np.cumsum(doc_lengths, out=starts[1:])
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int64)
    sample_index[0] = (0, 0)  # Megatron's first row, even if the first document is empty
    # In chunks: bounded temporaries, and a stop signal is seen between chunks (it raises in Python code).
    for begin in range(0, num_samples, _CHUNK):
        end = min(begin + _CHUNK, num_samples)
        last = np.arange(begin + 1, end + 1, dtype=np.int64) * seq_length + extra - 1
        rows = np.searchsorted(starts, last, side="right") - 1
        sample_index[begin + 1 : end + 1, 0] = rows
        sample_index[begin + 1 : end + 1, 1] = last - starts[np.minimum(rows, len(doc_lengths) - 1)] + 1 - extra
    if num_samples and num_samples * seq_length + extra - 1 >= starts[-1]:  # the partial last sample
        sample_index[-1] = (len(document_index) - 1, int(doc_lengths[-1]) - extra)
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


@dataclass(frozen=True)
class IndexPlan:
    """What build_indices will build, known from counts alone (so its size can be checked first)."""

    epochs: int
    separate_final: bool
    total_samples: int
    document_entries: int  # entries of the document index: epochs * documents

    def nbytes(self) -> int:
        """Bytes of the three arrays (data/index_budget.py)."""
        return index_nbytes(self.document_entries, self.total_samples)


def plan_indices(
    sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int | None, options: SampleOptions
) -> IndexPlan:
    """Epochs and sample counts of the split's indices; ValueError for a split without tokens."""
    extra = int(options.extra_token)
    tokens_per_epoch = int(sizes[documents].astype(np.int64).sum())
    if tokens_per_epoch < 1:  # Megatron would loop forever looking for enough epochs
        raise ValueError(f"split has {len(documents)} documents and no tokens")
    epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples, extra)
    separate = separate_final_epoch(tokens_per_epoch, seq_length, num_samples, epochs, extra)
    total = total_samples(epochs * tokens_per_epoch, seq_length, options)
    return IndexPlan(epochs, separate, total, epochs * len(documents))


def build_indices(
    sizes: np.ndarray,
    documents: np.ndarray,
    seq_length: int,
    num_samples: int | None,
    seed: int,
    options: SampleOptions,
    plan: IndexPlan | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) for the split's `documents` (ids into `sizes`).

    num_samples None builds one epoch (Megatron's mid-level datasets of an unweighted blend).
    """
    plan = plan or plan_indices(sizes, documents, seq_length, num_samples, options)
    extra = int(options.extra_token)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, plan.epochs, rng, plan.separate_final)
    total = plan.total_samples
    sample_index = build_sample_index(sizes, document_index, seq_length, total, options.extra_token)
    tokens_per_epoch = int(sizes[documents].astype(np.int64).sum())
    before_final = ((plan.epochs - 1) * tokens_per_epoch - extra) // seq_length if plan.separate_final else total
    shuffle_index = build_shuffle_index(before_final, total, rng)
    return document_index, sample_index, shuffle_index


def save_atomic(path: str, array: np.ndarray) -> None:
    """Write `array` as .npy under a temporary name in chunks, then rename it into place with the umask's
    mode: readers never see a partial file, and a stop signal between chunks leaves no temporary file."""
    with atomic_output(path) as tmp:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=array.dtype, shape=array.shape)
        try:
            for begin in range(0, len(array), _CHUNK):
                out[begin : begin + _CHUNK] = array[begin : begin + _CHUNK]
            out.flush()
        finally:
            del out  # unmaps the file before it is renamed or removed


def load_cached_array(path: str, length: int | None = None) -> np.ndarray | None:
    """The integer array cached in the .npy file `path`, memory-mapped; None (a warning naming the file and why)
    when the file cannot be read as one, or its length is not `length`: a cache is rebuilt, not trusted."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:  # numpy's "Array can't be memory-mapped", a cut header, ...
        problem = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    else:
        if array.dtype.kind in "iu" and (length is None or len(array) == length):
            return array
        problem = f"{array.dtype} array of shape {list(array.shape)}, not {length} integers"
    logging.getLogger(__name__).warning("index cache %s is damaged (%s): rebuilding it", path, problem)
    return None


class GPTDataset:
    """Samples of seq_length + 1 tokens (seq_length without the extra token) from documents [begin, end).

    `__getitem__(i)` returns {"text": int64 array, "length": tokens read}, a partial last sample padded with
    PAD_ID after `length` tokens (the length, not the value, marks padding: data ids are never clamped); len() is the
    number of samples built (at least num_samples; one epoch when num_samples is None). Index arrays are
    cached as .npy under cache_dir (keyed by an MD5 of the description) and memory-mapped when present.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        split_name: str,
        document_range: tuple[int, int],
        seq_length: int,
        seed: int,
        num_samples: int | None,
        cache_dir: str | None,
        options: SampleOptions,
    ):
        self.indexed = indexed
        self.seq_length = seq_length
        self.options = options
        documents = np.arange(*document_range, dtype=np.int32)
        sizes = indexed.sequence_lengths
        self.description = dict(
            cache_format=_CACHE_FORMAT,
            class_name="GPTDataset",
            path_prefix=os.path.abspath(indexed.path_prefix),
            split=split_name,
            document_range=list(document_range),
            seq_length=seq_length,
            seed=seed,
            num_samples=num_samples,
            tokens_in_split=int(sizes[documents].astype(np.int64).sum()),
        )
        if options != UNKEYED_OPTIONS:  # keys only when set, so existing caches stay valid
            self.description.update(extra_token=options.extra_token, drop_last_partial=options.drop_last_partial)
        self.cache_key = hashlib.md5(json.dumps(self.description, sort_keys=True).encode()).hexdigest()
        arrays = self._load_cache(cache_dir)
        if arrays is None:
            arrays = self._build(documents, num_samples, seed, cache_dir)
        self.document_index, self.sample_index, self.shuffle_index = arrays

    def _build(self, documents: np.ndarray, num_samples: int | None, seed: int, cache_dir: str | None):
        """Plan, check the size against disk and memory, build, then cache (when cache_dir is given)."""
        name = f"{self.indexed.path_prefix}: {self.description['split']}"
        sizes = self.indexed.sequence_lengths
        try:
            plan = plan_indices(sizes, documents, self.seq_length, num_samples, self.options)
        except ValueError as exc:
            raise ValueError(f"{name} {exc}") from None
        detail = (
            f"{plan.total_samples:,} samples of {self.seq_length} tokens: {plan.epochs:,} epoch(s) of "
            f"{self.description['tokens_in_split']:,} tokens"
        )
        check_index_fits(plan.nbytes(), cache_dir, f"{name} split", detail)
        arrays = build_indices(sizes, documents, self.seq_length, num_samples, seed, self.options, plan)
        if cache_dir is not None:
            try:
                self._save_cache(cache_dir, arrays)
            except OSError as exc:  # e.g. read-only data folder: train on, rebuild next time
                logging.getLogger(__name__).warning(
                    "index cache not written to %s (%s); indices kept in memory", cache_dir, exc
                )
        return arrays

    def _cache_paths(self, cache_dir: str) -> list[str]:
        return [
            os.path.join(cache_dir, f"{self.cache_key}-GPTDataset-{name}.npy")
            for name in ("document_index", "sample_index", "shuffle_index")
        ]

    def _load_cache(self, cache_dir: str | None):
        if cache_dir is None:
            return None
        remove_stale_temporaries(cache_dir)  # left by a killed build (kill -9): never read, only in the way
        paths = self._cache_paths(cache_dir)
        if not all(os.path.exists(p) for p in paths):
            return None
        arrays = tuple(load_cached_array(p) for p in paths)
        return None if any(a is None for a in arrays) else arrays  # a damaged file: rebuilt and rewritten

    def _save_cache(self, cache_dir: str, arrays) -> None:
        os.makedirs(cache_dir, exist_ok=True)
        description_path = os.path.join(cache_dir, f"{self.cache_key}-GPTDataset-description.txt")
        with atomic_output(description_path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
            json.dump(self.description, handle, indent=2, sort_keys=True)
        # The shuffle index is written last: its presence is what makes a cache complete, see _load_cache.
        for path, array in zip(self._cache_paths(cache_dir), arrays):
            save_atomic(path, array)

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def __getitem__(self, i: int) -> dict:
        j = int(self.shuffle_index[i])
        doc_beg, off_beg = (int(x) for x in self.sample_index[j])
        doc_end, off_end = (int(x) for x in self.sample_index[j + 1])
        get, docs, extra = self.indexed.get, self.document_index, int(self.options.extra_token)
        if doc_beg == doc_end:
            tokens = get(int(docs[doc_beg]), offset=off_beg, length=off_end - off_beg + extra)
        else:
            parts = [get(int(docs[doc_beg]), offset=off_beg)]
            parts += [get(int(docs[k])) for k in range(doc_beg + 1, doc_end)]
            parts.append(get(int(docs[doc_end]), length=off_end + extra))
            tokens = np.concatenate(parts)
        text = np.asarray(tokens, dtype=np.int64)
        length = len(text)
        missing = self.seq_length + extra - length
        if missing > 0:  # the kept partial last sample
            text = np.concatenate((text, np.full(missing, PAD_ID, dtype=np.int64)))
        return {"text": text, "length": length}

    def locate_token(self, sample: int, position: int) -> TokenSource:
        """Which document (and token of it) token `position` of sample `sample` comes from, read from the
        index arrays exactly as `__getitem__` reads the tokens."""
        row = int(self.shuffle_index[sample])
        doc_pos, offset = (int(x) for x in self.sample_index[row])
        last_pos = int(self.sample_index[row + 1][0])
        sizes = self.indexed.sequence_lengths
        while doc_pos < last_pos:  # walk the documents the sample spans until `position` falls inside one
            document = int(self.document_index[doc_pos])
            available = int(sizes[document]) - offset
            if position < available:
                break
            position -= available
            doc_pos, offset = doc_pos + 1, 0
        return TokenSource(self.indexed.path_prefix, int(self.document_index[doc_pos]), offset + position)
