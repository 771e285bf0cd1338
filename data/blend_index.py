"""Megatron's blending index (dataset_index, dataset_sample_index) built with numpy alone, bit-identical.

The rule (megatron-core helpers.cpp, build_blending_indices): sample i goes to the dataset d maximising
w_d * max(i, 1.0) - count_d in doubles (ties to the lowest d), and takes that dataset's next sample. Each
step depends on the counts before it, so a plain loop is sequential (about 1 s per million samples in
Python). Here the index is cut into blocks that run side by side, one numpy operation per step covering
every block:
- Each block starts `warmup` steps before its first sample, from counts that are only approximately right
  (floor(w * i) topped up by largest remainder). The greedy rule pulls any count vector back to the one
  it would have had: a dataset that is ahead is not picked until the others catch up, which takes about
  1 / w_min steps, so after the warm-up the block follows the exact sequence.
- That is checked, not assumed: a block is exact when its counts at its first sample equal the previous
  (exact) block's counts at its end. A block that fails the check is recomputed from those exact counts;
  by induction from block 0 (which starts at 0 with empty counts) every block is then exact.
The floating-point operations are those of the C++ loop (one multiply, one subtract, strict comparison),
so ties and rounding fall the same way.
"""
from __future__ import annotations

import numpy as np

_MIN_BLOCK = 1024


def build_blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16 [size], dataset_sample_index int64 [size]), as megatron-core's helper."""
    w = np.asarray(weights, dtype=np.float64)
    if size <= 0:
        return np.zeros(0, dtype=np.int16), np.zeros(0, dtype=np.int64)
    if len(w) == 1:
        return np.zeros(size, dtype=np.int16), np.arange(size, dtype=np.int64)
    positive = w[w > 0]
    warmup = int(min(size, 4.0 / positive.min() + 32))  # 2 / w_min + 16 sufficed in every test
    block = max(4 * warmup, _MIN_BLOCK)
    num_blocks = max(1, -(-size // block)) if size > 2 * block else 1
    if num_blocks == 1:
        block = size
    # Row b of the outputs holds samples [b * block, (b + 1) * block).
    dataset_index = np.empty((num_blocks, block), dtype=np.int16)
    dataset_sample_index = np.empty((num_blocks, block), dtype=np.int64)
    first = np.maximum(np.arange(num_blocks, dtype=np.int64) * block - warmup, 0)
    counts = _approximate_counts(w, first)
    snaps = _run_blocks(w, first, counts, dataset_index, dataset_sample_index, warmup)
    if num_blocks > 1:
        end_counts = np.concatenate((snaps["block_0_end"], counts[:, 1:]), axis=1)  # exact iff block exact
        _repair_blocks(w, dataset_index, dataset_sample_index, snaps["start"], end_counts)
    return dataset_index.reshape(-1)[:size], dataset_sample_index.reshape(-1)[:size]


def _approximate_counts(w: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Counts [D, blocks] near those the rule has at step `first`: floor(w * i), remainder to the largest
    fractional parts, so that they sum to i."""
    position = first.astype(np.float64)
    ideal = w[:, None] * position[None, :]
    counts = np.floor(ideal)
    missing = first - counts.sum(axis=0)
    order = np.argsort(counts - ideal, axis=0, kind="stable")  # largest fractional part first
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(len(w))[:, None].repeat(len(first), axis=1), axis=0)
    return counts + (rank < missing[None, :])


def _run_blocks(w: np.ndarray, first: np.ndarray, counts: np.ndarray, index_out: np.ndarray,
                sample_out: np.ndarray, warmup: int) -> dict:
    """Run the rule from step `first` [blocks] with float64 `counts` [D, blocks] (updated in place).

    Block 0 starts exactly (step first[0], no warm-up) and writes its steps [0, L) to row 0 of the
    outputs [blocks, L]; blocks b >= 1 run `warmup` steps more and write steps [warmup, warmup + L) to
    row b. Returns the counts where the blocks' rows start ("start") and where block 0's row ends.
    """
    num_datasets, num_blocks = counts.shape
    length = index_out.shape[1]
    steps = length + (warmup if num_blocks > 1 else 0)
    x = first.astype(np.float64)
    errors = np.empty((num_datasets, num_blocks))
    best_error = np.empty(num_blocks)
    better = np.empty(num_blocks, dtype=bool)
    one_hot = np.empty((num_datasets, num_blocks), dtype=bool)
    dataset_ids = np.arange(num_datasets, dtype=np.int8)[:, None]
    column_weights = w[:, None]
    # Steps are recorded row by row (contiguous writes) and transposed into the [blocks, L] outputs once
    # at the end: writing one column per step would touch a page per block every step.
    record_index = np.empty((steps, num_blocks), dtype=np.int8 if num_datasets <= 127 else np.int16)
    record_sample = np.empty((steps, num_blocks))  # counts are exact integers in float64
    candidate = np.empty(num_blocks, dtype=record_index.dtype)
    snaps = {}
    for t in range(steps):
        if t == warmup:
            snaps["start"] = counts.copy()
        if t == length:
            snaps["block_0_end"] = counts[:, :1].copy()
        x_t = np.maximum(x, 1.0) if t == 0 else x  # only the first step of block 0 sits at i = 0
        np.multiply(column_weights, x_t, out=errors)
        np.subtract(errors, counts, out=errors)  # w_d * x - count_d, the helper's two roundings
        _argmax_step(errors, counts, record_index[t], record_sample[t], best_error, better, candidate)
        np.equal(record_index[t][None, :], dataset_ids, out=one_hot)
        counts += one_hot
        x += 1.0
    index_out[0], sample_out[0] = record_index[:length, 0], record_sample[:length, 0]
    if num_blocks > 1:
        index_out[1:] = record_index[warmup:, 1:].T
        sample_out[1:] = record_sample[warmup:, 1:].T
    return snaps


def _argmax_step(errors, counts, best, chosen_count, best_error, better, candidate) -> None:
    """best = first argmax over d of errors [D, blocks] (the helper's strict >), chosen_count = its count.

    d beats every earlier dataset when better is set, so the last d that wins is the argmax: a running
    max of d * better (small integers, cheap) instead of masked writes.
    """
    num_datasets = errors.shape[0]
    chosen_count[:] = counts[0]
    np.greater(errors[1], errors[0], out=better)  # strict: ties stay with the lower d
    best[:] = better.view(np.int8)
    np.putmask(chosen_count, better, counts[1])
    np.maximum(errors[0], errors[1], out=best_error)
    for d in range(2, num_datasets):
        np.greater(errors[d], best_error, out=better)
        np.multiply(better.view(np.int8), best.dtype.type(d), out=candidate, casting="unsafe")
        np.maximum(best, candidate, out=best, casting="unsafe")
        np.putmask(chosen_count, better, counts[d])
        if d < num_datasets - 1:
            np.maximum(best_error, errors[d], out=best_error)


def _repair_blocks(w, index_out, sample_out, start_counts, end_counts) -> None:
    """Recompute, in order, every block whose starting counts differ from the exact end of the one before."""
    num_blocks, length = index_out.shape
    pending = list(np.flatnonzero((start_counts[:, 1:] != end_counts[:, :-1]).any(axis=0)) + 1)
    while pending:
        b = pending.pop(0)
        counts = end_counts[:, b - 1:b].copy()
        _run_blocks(w, np.array([b * length]), counts, index_out[b:b + 1], sample_out[b:b + 1], 0)
        start_counts[:, b] = end_counts[:, b - 1]
        end_counts[:, b] = counts[:, 0]
        following = b + 1
        if following < num_blocks and following not in pending and \
                (start_counts[:, following] != end_counts[:, b]).any():
            pending.insert(0, following)
