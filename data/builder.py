"""build_train_valid_test_datasets: prefixes (optionally weighted) + a split string -> three datasets."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from data.blended_dataset import BlendedDataset, normalize_weights
from data.gpt_dataset import GPTDataset, SampleOptions
from data.indexed_dataset import IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[tuple[float, float] | None]:
    """'969,30,1' -> [(begin, end) fraction per split, or None when empty], as Megatron normalises it."""
    parsed = [_as_number(v) for v in re.findall(r"[.0-9]+", str(split))]
    values = [v for v in parsed if v is not None]
    if not values or len(values) != len(parsed) or len(values) > 3 or sum(values) <= 0:
        raise ValueError(f"data.split={split!r}: expected up to three non-negative numbers like '969,30,1'")
    values += [0.0] * (3 - len(values))
    fractions = (np.array(values) / np.sum(values)).tolist()
    bookends = [0.0]
    for f in fractions:
        bookends.append(bookends[-1] + f)
    return [(b, e) if e > b else None for b, e in zip(bookends[:-1], bookends[1:])]


def document_range(bounds: tuple[float, float], num_documents: int) -> tuple[int, int]:
    """Document [begin, end) of a split's fraction bounds: round(fraction * N) at both ends (Python's
    round, as Megatron)."""
    begin, end = (round(b * float(num_documents)) for b in bounds)
    return begin, end


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int] | None]:
    """Document [begin, end) of each split, None when it has no share or rounds to no documents."""
    ranges = [None if bounds is None else document_range(bounds, num_documents) for bounds in parse_split(split)]
    return [r if r is not None and r[1] > r[0] else None for r in ranges]


def parse_data_path(data_path: list, key: str = "data.data_path") -> tuple[list[float] | None, list[str]]:
    """Megatron's blend list: [p1, p2, ...] -> (None, prefixes), blended by dataset size;
    [w1, p1, w2, p2, ...] -> (normalised weights, prefixes). Anything else (a weight without its prefix, a
    prefix where a weight belongs, a weight <= 0) is a one-line error naming `key` (the config key that gave the list)."""
    entries = [str(x).strip() for x in data_path]
    if not entries:
        raise ValueError(f"{key} is empty")
    if "" in entries:
        raise ValueError(f"{key}={entries}: entry {entries.index('')} is empty: give a data prefix (or a weight)")
    numbers = [_as_number(x) for x in entries]
    if all(n is None for n in numbers):
        return None, entries
    if len(entries) % 2:
        raise ValueError(
            f"{key}={entries} has {len(entries)} entries with weights among them: a weighted blend is "
            f"pairs [weight, prefix, weight, prefix, ...], an unweighted one prefixes only"
        )
    for k, (entry, number) in enumerate(zip(entries, numbers)):
        if (number is None) == (k % 2 == 0):  # even places hold weights, odd places prefixes
            role = "a weight" if k % 2 == 0 else "a prefix"
            raise ValueError(
                f"{key}={entries}: entry {k} ({entry!r}) stands where {role} is expected: give pairs "
                f"[weight, prefix, ...]"
            )
    weights = [n for n in numbers[0::2] if n is not None]
    for weight, prefix in zip(weights, entries[1::2]):
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(
                f"{key}: weight {weight:g} of {prefix} must be a positive number: drop the pair or give it a weight > 0"
            )
    return normalize_weights(weights), entries[1::2]


def _as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class BuildOptions:
    """Megatron's GPTDatasetConfig options (the data section's add_extra_token_to_sequence,
    drop_last_partial_validation_sequence, mid_level_dataset_surplus; operations/startup.build_options): see
    SampleOptions; mid_level_surplus is the margin each blend component is built with."""

    extra_token: bool
    drop_last_partial_validation: bool
    mid_level_surplus: float

    def samples(self, split_name: str) -> SampleOptions:
        """The sample options of one split (only valid may keep its partial last sample)."""
        keep_partial = split_name == "valid" and not self.drop_last_partial_validation
        return SampleOptions(extra_token=self.extra_token, drop_last_partial=not keep_partial)


def _build_single(prefix: str, split: str, seq_length: int, seed: int, num_samples, cache_dir, options: BuildOptions):
    """One GPTDataset per split of `prefix` (None where the split or its sample count is 0).

    num_samples[k] None builds one epoch. A split with a share of the data but no documents or no tokens
    is an error naming it (Megatron would loop forever looking for enough epochs).
    """
    indexed = IndexedDataset(prefix)
    # Megatron's GPTDataset splits by sequence count (one sequence per document, empty documents hold none):
    # numel_low_level_dataset = len(sequence_lengths). document_count would overrun when a document is empty.
    if len(indexed) == 0:
        raise ValueError(f"{prefix}: the dataset holds no documents")
    datasets: list[GPTDataset | None] = []
    for name, bounds, n in zip(SPLIT_NAMES, parse_split(split), num_samples):
        if bounds is None or n == 0:
            datasets.append(None)
            continue
        begin, end = document_range(bounds, len(indexed))
        if end <= begin:
            raise ValueError(
                f"{prefix}: the {name} split is empty: split {split!r} gives it documents "
                f"[{begin}, {end}) of {len(indexed)}"
            )
        datasets.append(GPTDataset(indexed, name, (begin, end), seq_length, seed, n, cache_dir, options.samples(name)))
    return datasets


def build_train_valid_test_datasets(
    data_path: list,
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | None,
    options: BuildOptions,
):
    """(train, valid, test) GPT datasets as Megatron's BlendedMegatronDatasetBuilder builds them; None
    where a split has no share or 0 samples are asked.

    One prefix: plain GPTDatasets. Weighted prefixes: each component built for
    ceil(ceil(n * w) * (1 + surplus)) samples, blended to sum(ceil(n * w)). Unweighted prefixes: one epoch
    of each, blended by their sizes to min(n, total) samples (fewer than asked when the epoch is short).
    cache_dir=None puts the index caches in `index-cache` next to the first prefix's files.
    """
    weights, prefixes = parse_data_path(data_path)
    if cache_dir is None:
        cache_dir = os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "index-cache")
    if weights is None and len(prefixes) == 1:
        return tuple(_build_single(prefixes[0], split, seq_length, seed, num_samples, cache_dir, options))
    if weights is None:
        asked = [[None if n else 0 for n in num_samples] for _ in prefixes]
    else:
        asked = [[_component_samples(n, w, options.mid_level_surplus) for n in num_samples] for w in weights]
    per_component = [
        _build_single(prefix, split, seq_length, seed, sizes, cache_dir, options)
        for prefix, sizes in zip(prefixes, asked)
    ]
    blended: list[BlendedDataset | None] = []
    for k, n in enumerate(num_samples):
        parts = [component[k] for component in per_component]
        if not n or all(p is None for p in parts):
            blended.append(None)
            continue
        part_weights: Sequence[float]
        if weights is None:
            sizes = [len(p) for p in parts]
            part_weights, size = sizes, min(n, sum(sizes))
        else:
            part_weights = weights
            size = sum(_component_samples(n, w, 0.0) for w in weights)
        blended.append(BlendedDataset(parts, part_weights, size, cache_dir, options.mid_level_surplus))
    return tuple(blended)


def _component_samples(num_samples: int, weight: float, surplus: float) -> int:
    """Samples a blend component is built for: ceil(ceil(n * w) * (1 + surplus)), Megatron's margin."""
    return math.ceil(math.ceil(num_samples * weight) * (1 + surplus)) if num_samples else 0


def build_split_datasets(
    split_paths: tuple[list, list, list],
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | None,
    options: BuildOptions,
):
    """Megatron's --train-data-path / --valid-data-path / --test-data-path: split k is built from its own
    blend list (as data_path), every document of it in that split; None where no path or 0 samples."""
    datasets: list[GPTDataset | BlendedDataset | None] = []
    for k, (path, n) in enumerate(zip(split_paths, num_samples)):
        if not path or not n:
            datasets.append(None)
            continue
        only_k = ",".join("1" if j == k else "0" for j in range(len(SPLIT_NAMES)))
        asked = (n if k == 0 else 0, n if k == 1 else 0, n if k == 2 else 0)
        datasets.append(build_train_valid_test_datasets(path, only_k, seq_length, seed, asked, cache_dir, options)[k])
    return tuple(datasets)
