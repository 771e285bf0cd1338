"""build_train_valid_test_datasets: prefixes (optionally weighted) + a split string -> three datasets."""
from __future__ import annotations

import os
import re

import numpy as np

from data.blended_dataset import BlendedDataset, component_num_samples, normalize_weights
from data.gpt_dataset import GPTDataset
from data.indexed_dataset import IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[tuple[float, float] | None]:
    """'969,30,1' -> [(begin, end) fraction per split, or None when empty], as Megatron normalises it."""
    values = [float(v) for v in re.findall(r"[.0-9]+", str(split))]
    if not values or len(values) > 3 or sum(values) <= 0:
        raise ValueError(f"bad split {split!r}: expected up to three non-negative numbers like '969,30,1'")
    values += [0.0] * (3 - len(values))
    fractions = (np.array(values) / np.sum(values)).tolist()
    bookends = [0.0]
    for f in fractions:
        bookends.append(bookends[-1] + f)
    return [(b, e) if e > b else None for b, e in zip(bookends[:-1], bookends[1:])]


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int] | None]:
    """Document [begin, end) of each split: round(fraction * N) at both ends (Python's round, as Megatron)."""
    ranges = []
    for bounds in parse_split(split):
        if bounds is None:
            ranges.append(None)
            continue
        begin, end = (int(round(b * float(num_documents))) for b in bounds)
        ranges.append((begin, end) if end > begin else None)
    return ranges


def parse_data_path(data_path: list) -> tuple[list[float], list[str]]:
    """[prefix] -> ([1.0], [prefix]); [w1, p1, w2, p2, ...] -> (normalised weights, prefixes)."""
    data_path = [str(x) for x in data_path]
    if len(data_path) == 1:
        return [1.0], data_path
    if len(data_path) % 2:
        raise ValueError(f"data_path must be [prefix] or [w1, prefix1, w2, prefix2, ...], got {data_path}")
    try:
        weights = [float(w) for w in data_path[0::2]]
    except ValueError:
        raise ValueError(f"data_path weights must be numbers, got {data_path[0::2]}") from None
    return normalize_weights(weights), data_path[1::2]


def _build_single(prefix: str, split: str, seq_length: int, seed: int, num_samples, cache_dir):
    indexed = IndexedDataset(prefix)
    # Megatron's GPTDataset splits by sequence count (one sequence per document, empty documents hold none):
    # numel_low_level_dataset = len(sequence_lengths). document_count would overrun when a document is empty.
    ranges = split_document_ranges(split, len(indexed))
    datasets = []
    for name, doc_range, n in zip(SPLIT_NAMES, ranges, num_samples):
        if doc_range is None or not n:
            datasets.append(None)
            continue
        datasets.append(GPTDataset(indexed, name, doc_range, seq_length, seed, int(n), cache_dir))
    return datasets


def build_train_valid_test_datasets(data_path: list, split: str, seq_length: int, seed: int,
                                    num_samples: tuple[int, int, int], cache_dir: str | None):
    """(train, valid, test) GPT datasets, blended when data_path holds weights; None for empty splits.

    cache_dir=None puts the index caches in `index-cache` next to the first prefix's files.
    """
    weights, prefixes = parse_data_path(data_path)
    if cache_dir is None:
        cache_dir = os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "index-cache")
    if len(prefixes) == 1:
        return tuple(_build_single(prefixes[0], split, seq_length, seed, num_samples, cache_dir))
    per_component = [
        _build_single(prefix, split, seq_length, seed,
                      [component_num_samples(n, w) if n else 0 for n in num_samples], cache_dir)
        for w, prefix in zip(weights, prefixes)]
    blended = []
    for k, n in enumerate(num_samples):
        parts = [component[k] for component in per_component]
        if not n or all(p is None for p in parts):
            blended.append(None)
            continue
        if any(p is None for p in parts):
            missing = [prefixes[d] for d, p in enumerate(parts) if p is None]
            raise ValueError(f"{SPLIT_NAMES[k]} split is empty in {missing} "
                             "but not in the other blend inputs")
        blended.append(BlendedDataset(parts, weights, int(n), cache_dir))
    return tuple(blended)
