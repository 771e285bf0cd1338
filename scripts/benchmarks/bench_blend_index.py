"""Blending index build time: ours (numba-compiled loop) against megatron-core's compiled helper when importable.

    python scripts/benchmarks/bench_blend_index.py --size 10000000 --weights 0.5 0.3 0.2 --rounds 5

Prints the best of --rounds for each (ours after one warm-up call, which compiles or loads the cached
machine code; that first call's time is printed too) and whether the arrays are identical.
"""

import argparse
import time

import numpy as np

from data.blend_index import build_blending_indices


def best_of(fn, rounds: int):
    """(best wall seconds, best CPU seconds of this process, result): on a shared machine the CPU time
    is the steadier figure (both builds are single-threaded)."""
    best, best_cpu, result = float("inf"), float("inf"), None
    for _ in range(rounds):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - start_cpu)
    return best, best_cpu, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=10_000_000)
    p.add_argument("--weights", type=float, nargs="+", default=[0.5, 0.3, 0.2])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    weights = (np.array(args.weights) / np.sum(args.weights)).tolist()
    start = time.perf_counter()
    build_blending_indices(weights, 8)
    print(f"first call (compile or load the cached code): {time.perf_counter() - start:.2f} s")
    ours_s, ours_cpu, ours = best_of(lambda: build_blending_indices(weights, args.size), args.rounds)
    print(
        f"numba blend index: {args.size} samples, weights {args.weights}: {ours_s:.3f} s wall, "
        f"{ours_cpu:.3f} s CPU (best of {args.rounds})"
    )
    try:
        from megatron.core.datasets import helpers_cpp
    except ImportError:
        print("megatron-core not importable: its helper not measured")
        return

    def helper():
        index, sample = np.zeros(args.size, np.int16), np.zeros(args.size, np.int64)
        helpers_cpp.build_blending_indices(index, sample, np.array(weights), len(weights), args.size, False)
        return index, sample

    theirs_s, theirs_cpu, theirs = best_of(helper, args.rounds)
    same = all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    print(
        f"megatron-core helper: {theirs_s:.3f} s wall, {theirs_cpu:.3f} s CPU (best of {args.rounds}); "
        f"identical arrays: {same}; ours / theirs: {ours_s / theirs_s:.2f} wall, {ours_cpu / theirs_cpu:.2f} CPU"
    )


if __name__ == "__main__":
    main()
