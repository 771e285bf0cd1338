"""Peak activation memory per rank under context parallelism, measured on CPU, against the planner.

Runs the real trainer (training/run.py build_run + training/loop.py train) on cp forked gloo ranks for a
4-layer GPT at seq 8192 (the tiny test corpus, fp32, dropout 0, one micro-batch of 1 per iteration) and
reports per case the peak bytes of tensors autograd saved for backward on the busiest rank (parameters
excluded, counted once per storage: bench_cpu_memory.SavedTensorMeter) and the planner's prediction
(planner/memory.rank_memory, activations; SDPA's CPU kernel keeps no [s, s] tensor without dropout, so one
process is "flash", and ring attention keeps the same as a flash kernel).

    PYTHONPATH=. python scripts/benchmarks/bench_context_parallel_memory.py [--cp 1 4] [--seq 8192]
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import tempfile

import torch
import torch.multiprocessing as mp

from config.schema import load_config
from data.sample_corpus import build_tiny_corpus
from parallel.layout import layout_from_config
from planner.activations import shape_from_config
from planner.memory import rank_memory
from scripts.benchmarks.bench_cpu_memory import SavedTensorMeter
from training.loop import train
from training.run import build_run
from training.setup import DEFAULT_CONFIG, init_distributed

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


def _rank(rank: int, world_size: int, port: int, overrides: list[str], results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    logging.disable(logging.INFO)
    config = load_config(DEFAULT_CONFIG, overrides)
    layout = layout_from_config(config, world_size)
    run = build_run(config, init_distributed(), layout)
    meter = SavedTensorMeter([p for chunk in run.ctx.chunks for p in chunk.parameters()])
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        train(run)
    shape = shape_from_config(config.model, config.parallel, config.train, attention="flash")
    predicted = rank_memory(config.model, layout, config.train, False, shape, 0, 0.0).activations
    results.put((rank, meter.peak, predicted))
    if world_size > 1:
        torch.distributed.destroy_process_group()


def measure(cp: int, seq: int, corpus: dict, tmp: str) -> tuple[int, float]:
    """(largest measured peak over the cp ranks, the planner's prediction) in bytes."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    overrides = [
        f"data.data_path=[{corpus['data_prefix']}]",
        f"data.vocab_file={corpus['vocab_file']}",
        f"data.merge_file={corpus['merge_file']}",
        "data.num_workers=0",
        *MODEL,
        f"model.seq_length={seq}",
        f"parallel.cp_size={cp}",
        "train.train_iters=1",
        "train.eval_iters=0",
        "optim.lr_warmup_iters=0",
        "checkpoint.save=false",
        "logging.tensorboard=false",
        f"run.dir={tempfile.mkdtemp(dir=tmp)}",
    ]
    results = mp.get_context("fork").SimpleQueue()
    mp.start_processes(_rank, args=(cp, port, overrides, results), nprocs=cp, join=True, start_method="fork")
    ranks = [results.get() for _ in range(cp)]
    return max(peak for _, peak, _ in ranks), ranks[0][2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seq", type=int, default=8192)
    args = parser.parse_args()
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        corpus = build_tiny_corpus(os.path.join(tmp, "corpus"))
        for cp in args.cp:
            measured, predicted = measure(cp, args.seq, corpus, tmp)
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
