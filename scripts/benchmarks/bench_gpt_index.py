"""Time GPT index building (document, sample, shuffle indices) for a synthetic 1-billion-token corpus.

Writes a real .idx (sequence lengths only; the .bin is a sparse file of the right size, never read) and
runs the real code path: IndexedDataset -> GPTDataset(...) with cache writing.

    python scripts/benchmarks/bench_gpt_index.py [--tokens 1e9] [--seq-length 2048] [--epochs 1]
"""

import argparse
import os
import tempfile
import time

import numpy as np

from config.data_config import DataConfig
from data.gpt_dataset import GPTDataset
from data.indexed_dataset import IndexedDataset, write_index
from operations.startup import build_options

SAMPLES = build_options(DataConfig()).samples("train")  # the data section's defaults, as the trainer builds them


def synthetic_corpus(prefix: str, tokens: int, seed: int = 0) -> int:
    """Documents with lognormal lengths (median ~600 tokens) summing to about `tokens`."""
    rng = np.random.RandomState(seed)
    n_docs = max(1, tokens // 900)
    lengths = np.clip(rng.lognormal(6.4, 1.0, size=n_docs), 1, 100_000).astype(np.int32)
    write_index(prefix + ".idx", np.uint16, lengths, np.arange(n_docs + 1))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(lengths.astype(np.int64).sum()) * 2)  # sparse: takes no disk space
    return n_docs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=float, default=1e9)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--epochs", type=float, default=1.0, help="samples requested, in epochs of the corpus")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "synthetic_text_document")
        n_docs = synthetic_corpus(prefix, int(args.tokens))
        ds = IndexedDataset(prefix)
        total = int(ds.sequence_lengths.astype(np.int64).sum())
        num_samples = int(total * args.epochs / args.seq_length) - 1
        start = time.perf_counter()
        gpt = GPTDataset(ds, "train", (0, n_docs), args.seq_length, 1234, num_samples, os.path.join(tmp, "c"), SAMPLES)
        built = time.perf_counter() - start
        start = time.perf_counter()
        GPTDataset(ds, "train", (0, n_docs), args.seq_length, 1234, num_samples, os.path.join(tmp, "c"), SAMPLES)
        cached = time.perf_counter() - start
        print(
            f"{total / 1e9:.3f}B tokens, {n_docs} documents, seq_length {args.seq_length}, "
            f"{len(gpt)} samples: indices built and cached in {built:.2f} s; reopened from cache in "
            f"{cached * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
