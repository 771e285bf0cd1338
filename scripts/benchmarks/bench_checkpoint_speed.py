"""Async vs sync checkpoint saves: how long the training loop is blocked per save.

One process builds a GPT with its plain fp32 optimizer (fp32 weights + Adam moments: 12 bytes per parameter on
disk), takes a few real training steps, then saves it through checkpoint.Checkpointer:
  sync   the loop is blocked for the whole save (DCP write, fsync, checksums, rename, trackers)
  async  a background thread copies the tensors aside, then writes them, while the loop keeps training; the
         loop is blocked only if its next optimizer step arrives before the copy is done (plus starting the
         thread). Step times during the write are printed next to the ones without.
Best of --rounds rounds; one Checkpointer per mode, as in a run (async reuses its copy buffers from the second
save on). The model defaults to ~19 M parameters (a ~230 MB checkpoint) so that a synchronous
save takes >= 2 s on a disk writing ~100 MB/s with fsync.

    python scripts/benchmarks/bench_checkpoint_save.py [--layers 6 --hidden 512 --rounds 3 --dir /tmp/x]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
from bench_models import model_config

from checkpoint import Checkpointer, CheckpointLayout, CheckpointParts, TrainingProgress, build_save_job
from config.schema import OptimConfig, ParallelConfig, TrainConfig
from optim.lr_schedule import LRSchedule
from optim.optimizer import build_optimizer
from parallel.data_parallel import DataParallel
from parallel.model_builder import build_model_chunks
from parallel.random import RNGTracker
from parallel.state import ParallelState


def build(layers: int, hidden: int):
    cfg = model_config(layers, hidden, heads=8, seq_length=128, vocab_size=8192)
    state = ParallelState.single()
    chunks: list[torch.nn.Module] = [*build_model_chunks(cfg, state, 1234, torch.device("cpu"), torch.float32)]
    parallel, optim = ParallelConfig(), OptimConfig(lr=1e-4)
    ddp = DataParallel(chunks, state, parallel.grad_bucket_size_mb, parallel.distributed_optimizer)
    optimizer = build_optimizer(chunks, ddp, state, optim, TrainConfig(), overlap_param_gather=False)
    return cfg, state, chunks, ddp, optimizer


def step(cfg, chunks, ddp, optimizer, checkpointer=None) -> float:
    """One forward/backward/AdamW step on random tokens, the checkpointer's seam before the update (as in
    training/train_step.py); returns its seconds."""
    started = time.perf_counter()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    positions = torch.arange(cfg.seq_length).expand(2, -1)
    ddp.zero_grad()
    chunks[0](input_ids=tokens, position_ids=positions, labels=tokens).mean().backward()
    ddp.finish_grad_sync()
    if checkpointer is not None:
        checkpointer.before_update()
    optimizer.step(1e-4)
    return time.perf_counter() - started


def one_save(built, checkpointer: Checkpointer, root: str, iteration: int) -> dict:
    cfg, state, chunks, ddp, optimizer = built
    async_save = checkpointer.async_save
    parts = CheckpointParts(
        state,
        chunks,
        optimizer,
        LRSchedule(1e-4, 1e-5, 0, 100, "cosine"),
        RNGTracker.seeded(1234, 0, 0, torch.device("cpu")),
        CheckpointLayout.of(state, sequence_parallel=False, distributed_optimizer=False, schedule="1f1b"),
    )
    job = build_save_job(root, parts, TrainingProgress(iteration, 0, 0), {"model": {}}, keep_last=0)
    started = time.perf_counter()
    checkpointer.save(job)
    steps = []
    while async_save and checkpointer._thread is not None and checkpointer._thread.is_alive():
        steps.append(step(cfg, chunks, ddp, optimizer, checkpointer))  # the loop trains during the write
    blocked = checkpointer._blocked if async_save else time.perf_counter() - started
    checkpointer.wait()
    return {"blocked": blocked, "total": time.perf_counter() - started, "steps_during_write": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    built = build(args.layers, args.hidden)
    cfg, _, chunks, ddp, optimizer = built
    params = sum(p.numel() for p in chunks[0].parameters())
    baseline = min(step(cfg, chunks, ddp, optimizer) for _ in range(3))
    workdir = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    log: list[str] = []
    checkpointers = {mode: Checkpointer(mode == "async", log.append) for mode in results}  # as in a run
    iteration = 0
    for _ in range(args.rounds):
        for mode in ("sync", "async"):
            iteration += 1
            root = os.path.join(workdir, mode)
            results[mode].append(one_save(built, checkpointers[mode], root, iteration))
            shutil.rmtree(root)
    sync_best = min(r["total"] for r in results["sync"])
    async_blocked = min(r["blocked"] for r in results["async"])
    async_total = min(r["total"] for r in results["async"])
    during = [s for r in results["async"] for s in r["steps_during_write"]]
    print(f"model: {params / 1e6:.1f} M parameters, checkpoint {log[0].split('(')[1].split(',')[0]}")
    print(f"sync save, loop blocked (best of {args.rounds}):  {sync_best:.2f} s")
    copy = min(float(line.split("copied aside in ")[1].split(" s")[0]) for line in log if "copied aside" in line)
    print(
        f"async save, loop blocked (best of {args.rounds}): {async_blocked:.3f} s  "
        f"({100 * async_blocked / sync_best:.1f}% of sync); copy aside {copy:.2f} s (overlapping forward and "
        f"backward), background write {async_total:.2f} s"
    )
    if during:
        print(
            f"training step: {baseline * 1e3:.0f} ms alone, median {sorted(during)[len(during) // 2] * 1e3:.0f} ms "
            f"while the background write runs ({len(during)} steps)"
        )
    if not args.dir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
