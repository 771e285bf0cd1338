"""Peak activation memory per rank under context parallelism, measured on CPU, against the planner.

Runs the real trainer (training/run.py build_run + training/loop.py train) on cp forked gloo ranks for a
4-layer GPT at seq 8192 (the tiny test corpus, fp32, dropout 0, one micro-batch of 1 per iteration) and
reports per case the peak bytes of tensors autograd saved for backward on the busiest rank (parameters
excluded, counted once per storage: bench_cpu_memory.measure) and the planner's prediction
(planner/memory.rank_memory, activations; SDPA's CPU kernel keeps no [s, s] tensor without dropout, so one
process is "flash", and ring attention keeps the same as a flash kernel).

    python scripts/benchmarks/bench_context_parallel_memory.py [--cp 1 4] [--seq 8192]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from bench_cpu_memory import measure  # a sibling script (its folder is on sys.path)

from config.schema import load_config
from data.sample_corpus import build_tiny_corpus
from data.tokenizers import build_tokenizer
from operations.startup import DEFAULT_CONFIG
from parallel.layout import layout_from_config
from planner.activations import shape_from_config
from planner.memory import rank_memory

MODEL = [
    "model.num_layers=4",
    "model.hidden_size=128",
    "model.num_attention_heads=4",
    "model.hidden_dropout=0.0",
    "model.attention_dropout=0.0",
    "model.make_vocab_size_divisible_by=8",
    "train.micro_batch_size=1",
    "train.global_batch_size=1",
]


def predicted_activations(overrides: list[str], world_size: int) -> float:
    """The planner's activation bytes for the busiest rank of this run (no process group needed)."""
    config = load_config(DEFAULT_CONFIG, overrides)
    layout = layout_from_config(config, world_size)
    shape = shape_from_config(config, layout, attention="flash")
    return rank_memory(config.model, layout, config.train, False, shape, 0, 0.0).activations


def measure_cp(cp: int, seq: int, corpus: dict, tmp: str) -> tuple[int, float]:
    """(largest measured peak over the cp ranks, the planner's prediction) in bytes."""
    overrides = [
        f"data.data_path=[{corpus['data_prefix']}]",
        f"data.vocab_file={corpus['vocab_file']}",
        f"data.merge_file={corpus['merge_file']}",
        *MODEL,
        f"model.seq_length={seq}",
        f"parallel.cp_size={cp}",
        "optim.lr_warmup_iters=0",
    ]
    ranks = measure(cp, overrides, 1, False, tmp)  # bench_cpu_memory's trainer run; these overrides win
    vocab = build_tokenizer("GPT2BPETokenizer", vocab_file=corpus["vocab_file"], merge_file=corpus["merge_file"])
    predicted = predicted_activations([*overrides, f"model.vocab_size={vocab.vocab_size}"], cp)
    return max(r["activations"] for r in ranks.values()), predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seq", type=int, default=8192)
    args = parser.parse_args()
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        corpus = build_tiny_corpus(os.path.join(tmp, "corpus"))
        for cp in args.cp:
            measured, predicted = measure_cp(cp, args.seq, corpus, tmp)
            base = measured if base is None else base
            error = (predicted - measured) / measured
            rows.append(
                f"| {cp} | {measured / 2**20:.1f} | {measured / base:.3f} | {predicted / 2**20:.1f} | {error:+.1%} |"
            )
            print(rows[-1], flush=True)
    print(
        f"\nseq {args.seq}, {' '.join(MODEL)}\n| cp | measured MiB (busiest rank) | vs first | planner MiB | "
        "planner error |\n|---|---|---|---|---|\n" + "\n".join(rows)
    )


if __name__ == "__main__":
    main()
