"""The trainer against a minimal hand-written torch loop of the same model, side by side in one process (CPU).

The trainer side runs the trainer's own per-iteration path on its default config (configs/gpt_tiny.yaml, data
from the sample corpus): take the micro-batches, the iteration boundary (stop signals, token-id check), the
train step (forward/backward per micro-batch, gradient buffers, clipping, AdamW on flat fp32 buffers) and the
counters / log line. The minimal side is what a person would write: the same GPTModel and weights,
torch.optim.AdamW, one forward/backward per micro-batch of random tokens, clip_grad_norm_, step, zero_grad.
Rounds alternate between the sides (a shared machine's load hits both alike); the best round of each counts.

    python scripts/benchmarks/bench_trainer_vs_minimal.py [--rounds 5] [--iters 5] [override ...]

Prints ms/iteration of both and the ratio minimal / trainer (>= 1.0: the trainer is at least as fast).
"""

from __future__ import annotations

import argparse
import time

import torch

from config.schema import load_config
from model.gpt import GPTModel
from operations.startup import DEFAULT_CONFIG, data_iterator, init_distributed
from parallel.layout import layout_from_config
from parallel.pipeline.forward import take_microbatches
from training.logging import IntervalStats
from training.loop import after_step, iteration_boundary
from training.run import Run, build_run
from training.train_step import train_step


def trainer_round(run: Run, data, stats: IntervalStats, iters: int) -> float:
    """Seconds per iteration of `iters` iterations of the trainer's loop body."""
    started = time.perf_counter()
    for _ in range(iters):
        microbatches = take_microbatches(data, run.ctx.num_microbatches)
        iteration_boundary(run, microbatches, started)
        lr = run.lr_schedule.lr(run.progress.iteration)
        step_start = time.perf_counter()
        result = train_step(run.ctx, microbatches, lr)
        after_step(run, stats, result, lr, time.perf_counter() - step_start)
    return (time.perf_counter() - started) / iters


def minimal_round(model: GPTModel, optimizer: torch.optim.Optimizer, batches: list, iters: int) -> float:
    """Seconds per iteration of the hand-written loop over the same micro-batch shapes."""
    started = time.perf_counter()
    for _ in range(iters):
        for ids, labels, positions in batches:
            (model(ids, positions, labels=labels).mean() / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - started) / iters


def build_minimal(run: Run) -> tuple[GPTModel, torch.optim.Optimizer, list]:
    """The same model (a copy of the trainer's weights), torch's AdamW, random micro-batches of its shape."""
    cfg, train_cfg = run.config.model, run.config.train
    model = GPTModel(cfg, cfg.padded_vocab_size())
    model.load_state_dict(run.ctx.chunks[0].state_dict())
    optim = run.config.optim
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps
    )
    mbs, seq = train_cfg.micro_batch_size, cfg.seq_length
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(seq).expand(mbs, seq)
    batches = [
        (torch.randint(0, run.vocab_size, (mbs, seq), generator=gen),) * 2 + (positions,)
        for _ in range(run.ctx.num_microbatches)
    ]
    return model, optimizer, batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5, help="iterations per round and side")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = ["train.eval_iters=0", "checkpoint.save=false", "logging.tensorboard=false", "train.device=cpu"]
    config = load_config(args.config, overrides + ["run.dir=/tmp/bench_trainer_vs_minimal"] + args.overrides)
    config.train.train_iters = 10**6  # the loop never ends on its own here
    run = build_run(config, init_distributed(False, config.train.num_threads), layout_from_config(config, 1))
    data = data_iterator(config, run.datasets[0], 0, 0, 1, run.eod_id)
    stats = IntervalStats(run.shape.flops, run.shape.tokens_per_iteration, 1, "cpu", None)
    model, optimizer, batches = build_minimal(run)
    trainer_round(run, data, stats, 1)  # warm-up: allocator, first-call imports
    minimal_round(model, optimizer, batches, 1)
    trainer_best = minimal_best = float("inf")
    for round_index in range(args.rounds):
        trainer_best = min(trainer_best, trainer_round(run, data, stats, args.iters))
        minimal_best = min(minimal_best, minimal_round(model, optimizer, batches, args.iters))
        print(f"round {round_index + 1}: trainer {trainer_best * 1e3:.1f} ms/iter, minimal {minimal_best * 1e3:.1f}")
    print(
        f"trainer {trainer_best * 1e3:.1f} ms/iter | minimal torch loop {minimal_best * 1e3:.1f} ms/iter | "
        f"ratio minimal/trainer {minimal_best / trainer_best:.3f} (best of {args.rounds} rounds x {args.iters} "
        f"iterations, sides interleaved, {torch.get_num_threads()} thread(s))"
    )
    run.metrics.close()


if __name__ == "__main__":
    main()
