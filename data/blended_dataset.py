"""Megatron's deterministic blend of several datasets by weight (no RNG).

Sample i goes to the dataset d maximising w_d * max(i, 1) - count_d (ties to the lowest d) and takes that
dataset's next sample, so every prefix of the blend follows the weights as closely as counts allow.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence

import numpy as np

from data.gpt_dataset import GPTDataset, TokenSource, load_cached_array, save_atomic


def normalize_weights(weights: Sequence[float | str]) -> list[float]:
    """Weights as floats summing to 1 (numbers or numeric strings accepted)."""
    values = np.array([float(w) for w in weights], dtype=np.float64)
    if (values < 0).any() or values.sum() <= 0:
        raise ValueError(f"blend weights must be non-negative with a positive sum, got {list(weights)}")
    return (values / values.sum()).tolist()


class BlendedDataset:
    """A weighted blend of datasets; item i is item dataset_sample_index[i] of dataset dataset_index[i].

    With cache_dir, the two index arrays are cached as .npy keyed by an MD5 of the description (weights,
    size, the components' own cache keys) and memory-mapped when present, as the GPT indices are.
    """

    def __init__(
        self,
        datasets: list[GPTDataset],
        weights: Sequence[float | str],
        size: int,
        cache_dir: str | None,
        surplus: float,
    ):
        self.datasets = datasets
        self.weights = normalize_weights(weights)
        self.size = size
        description = dict(
            class_name="BlendedDataset",
            weights=self.weights,
            size=size,
            components=[getattr(d, "cache_key", repr(d)) for d in datasets],
        )
        self.cache_key = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
        paths = (
            [
                os.path.join(cache_dir, f"{self.cache_key}-BlendedDataset-{name}.npy")
                for name in ("dataset_index", "dataset_sample_index")
            ]
            if cache_dir
            else []
        )
        cached = [load_cached_array(p, size) for p in paths if os.path.exists(p)]  # damaged: None, rebuilt
        dataset_index, sample_index = cached if len(cached) == 2 else (None, None)
        if dataset_index is not None and sample_index is not None:
            self.dataset_index, self.dataset_sample_index = dataset_index, sample_index
        else:
            from data.blend_index import build_blending_indices  # numba (~0.4 CPU s): only a blend builds one

            self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, size)
            if cache_dir and paths:
                self._save(cache_dir, paths)
        for d, dataset in enumerate(datasets):
            needed = int((self.dataset_index == d).sum())
            if len(dataset) < needed:
                name = getattr(getattr(dataset, "indexed", None), "path_prefix", f"component {d}")
                raise ValueError(
                    f"blend oversamples {name}: needs {needed} samples, it has {len(dataset)}; "
                    f"raise data.mid_level_dataset_surplus (now {surplus})"
                )

    def _save(self, cache_dir: str, paths: list[str]) -> None:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            for path, array in zip(paths, (self.dataset_index, self.dataset_sample_index)):
                save_atomic(path, array)
        except OSError as exc:  # e.g. read-only data folder: blend on, rebuild next time
            logging.getLogger(__name__).warning("blend cache not written to %s (%s)", cache_dir, exc)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        d = int(self.dataset_index[i])
        return self.datasets[d][int(self.dataset_sample_index[i])]

    def locate_token(self, sample: int, position: int) -> TokenSource:
        """Which component's document token `position` of sample `sample` comes from (GPTDataset.locate_token)."""
        component = self.datasets[int(self.dataset_index[sample])]
        return component.locate_token(int(self.dataset_sample_index[sample]), position)
