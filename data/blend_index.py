"""Megatron's blending index (dataset_index, dataset_sample_index), compiled with numba, bit-identical.

The rule (megatron-core helpers.cpp, build_blending_indices): sample i goes to the dataset d maximising
w_d * max(i, 1.0) - count_d in doubles (ties to the lowest d), and takes that dataset's next sample. Each
step depends on the counts before it, so the index is a sequential loop: about 1 s per million samples in
Python. numba compiles the same loop (the same double operations, the same strict comparison, so ties and
rounding fall the same way) to machine code at the speed of megatron-core's C++ helper, from a wheel with no
compiler at install. The compiled function is cached next to this file (`cache=True`) where the folder is
writable; otherwise the first call of each process compiles it (about 1 s).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def _greedy_blend(weights: np.ndarray, dataset_index: np.ndarray, dataset_sample_index: np.ndarray) -> None:
    """Fill both [size] outputs with Megatron's greedy rule (see the module docstring)."""
    counts = np.zeros(weights.shape[0], dtype=np.int64)
    for i in range(dataset_index.shape[0]):
        position = max(float(i), 1.0)
        best = 0
        best_error = weights[0] * position - counts[0]
        for d in range(1, weights.shape[0]):
            error = weights[d] * position - counts[d]
            if error > best_error:
                best_error = error
                best = d
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1


def build_blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16 [size], dataset_sample_index int64 [size]), as megatron-core's helper."""
    dataset_index = np.empty(max(size, 0), dtype=np.int16)
    dataset_sample_index = np.empty(max(size, 0), dtype=np.int64)
    if size > 0:
        _greedy_blend(np.ascontiguousarray(weights, dtype=np.float64), dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index
