"""Checkpoint speed against the disk it writes to: the trainer's saves (sync and async) and loads of a real
model state, beside torch.distributed.checkpoint and torch.save writing the same tensors directly, beside the
disk's own sequential write and read bandwidth, all measured in one run.

One process builds the model of configs/gpt2_355m.yaml (355 M parameters, the config's precision: bf16
weights, fp32 master weights and Adam moments) and its optimizer the way the trainer does (training/run.py),
takes one training step on a short random sequence so that the moments exist, then times:
  disk         one file of the trainer checkpoint's size: 16 MiB buffered writes + fsync; read back 16 MiB at
               a time after dropping it from the page cache (posix_fadvise DONTNEED)
  trainer      checkpoint.Checkpointer (as the loop saves) and the resume path (plan_resume's checks: sizes, the
               small files' CRC-32; then load_into_run's one pass over the data files: weights and optimizer
               state read, and each file's CRC-32 taken, from the same bytes)
  trainer async  the time save() blocks the loop, the copy aside, and the background write until wait()
  dcp          dcp.save / dcp.load of a plain {key: tensor} dict of the same tensors (FileSystemWriter defaults)
  torch.save   torch.save of that dict into one file + fsync; torch.load of it
Every write ends with its files fsynced; before every read the files are dropped from the page cache. The
table gives GB/s (10^9 bytes) and the share of the disk's bandwidth; best of --rounds rounds. Memory: the
model's state plus at most one more copy (the async save's staging buffers, or torch.load's result).

    python scripts/benchmarks/bench_checkpoint_speed.py [--dir runs/ckptbench --rounds 1 --config PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp

from checkpoint import (
    Checkpointer,
    CheckpointLayout,
    CheckpointParts,
    TrainingProgress,
    build_save_job,
    dir_size,
    load_into_run,
    plan_resume,
)
from config.schema import Config, load_config
from model.precision import precision_dtype
from parallel.comm import Collectives
from parallel.layout import Layout
from parallel.model_builder import build_model_chunks
from parallel.random import RNGTracker
from parallel.state import ParallelState
from training.run import build_optimizer_and_schedule

BLOCK = 16 << 20  # bytes per write() / read() of the disk's own measurement


@dataclass
class Built:
    """The run's parts a checkpoint is written from and loaded into, and what a training step needs."""

    config: Config
    parts: CheckpointParts
    ddp: object


def build(config: Config) -> Built:
    """Model chunks, data parallelism, optimizer and LR schedule as training/run.py builds them (one process)."""
    state, layout = ParallelState.single(), Layout.single()
    dtype = precision_dtype(config.train.precision)
    chunks = build_model_chunks(config.model, state, config.train.seed, torch.device("cpu"), dtype)
    ddp, optimizer, lr_schedule = build_optimizer_and_schedule(config, list[torch.nn.Module](chunks), state, layout)
    recorded = CheckpointLayout.of(state, sequence_parallel=False, distributed_optimizer=False, schedule="1f1b")
    rng = RNGTracker.seeded(config.train.seed, 0, 0, torch.device("cpu"))
    return Built(config, CheckpointParts(state, chunks, optimizer, lr_schedule, rng, recorded), ddp)


def train_step(built: Built, tokens: int, checkpointer: Checkpointer | None = None) -> float:
    """Forward, backward and the optimizer step on `tokens` random tokens (the moments then exist); an async
    save's copy is awaited before the update, as training/train_step.py does. Returns the seconds spent
    waiting for that copy."""
    vocab = built.config.model.vocab_size
    assert vocab is not None, "the config names its vocabulary size (no tokenizer is built here)"
    ids = torch.randint(0, vocab, (1, tokens))
    positions = torch.arange(tokens).expand(1, -1)
    built.ddp.zero_grad()  # type: ignore[attr-defined]
    built.parts.chunks[0](input_ids=ids, position_ids=positions, labels=ids).mean().backward()
    built.ddp.finish_grad_sync()  # type: ignore[attr-defined]
    started = time.perf_counter()
    if checkpointer is not None:
        checkpointer.before_update()
    waited = time.perf_counter() - started
    built.parts.optimizer.step(built.config.optim.lr)
    return waited


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(base, name) for base, _, names in os.walk(path) for name in names]


def drop_from_cache(path: str) -> None:
    """Evict the (clean, fsynced) pages of every file under `path` from the page cache, so that a read comes
    from the disk; the host of a virtual disk may still cache them (the disk's cold and warm reads show it)."""
    os.sync()
    for name in files_under(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_file(path: str) -> int:
    """Read `path` sequentially into one reused buffer; returns the bytes read."""
    buffer, total = bytearray(BLOCK), 0
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            total += count
    return total


def disk_bandwidth(workdir: str, size: int) -> dict[str, float]:
    """Seconds to write `size` bytes (buffered 16 MiB writes + fsync), read them back after dropping them from
    the page cache (cold), and read them again without dropping (warm: what a cache that was not dropped gives)."""
    path = os.path.join(workdir, "disk_probe.bin")
    block = os.urandom(BLOCK)  # incompressible, in case the storage compresses
    os.sync()
    started = time.perf_counter()
    with open(path, "wb") as handle:
        for _ in range(size // BLOCK):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    write = time.perf_counter() - started
    drop_from_cache(path)
    started = time.perf_counter()
    read_bytes = read_file(path)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    read_file(path)
    warm = time.perf_counter() - started
    os.remove(path)
    return {"bytes": read_bytes, "write": write, "read": cold, "read_warm": warm}


def plain_state_dict(built: Built) -> dict[str, torch.Tensor]:
    """The tensors the trainer's checkpoint holds, as a plain {key: tensor} dict (one process: one piece each)."""
    job = build_save_job("unused", built.parts, TrainingProgress(1), {}, keep_last=0)
    return {key: pieces.pieces[0][1] for key, pieces in job.tensors.items()}


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def trainer_sync(built: Built, root: str, iteration: int) -> dict[str, float]:
    """Save through the loop's Checkpointer (sync), then resume from it as a restarted run does."""
    checkpointer = Checkpointer(False, lambda message: None)
    config = built.config.to_dict()
    job = build_save_job(root, built.parts, TrainingProgress(iteration), config, keep_last=0)
    os.makedirs(root, exist_ok=True)
    save = timed(lambda: checkpointer.save(job))
    written = dir_size(root)
    drop_from_cache(root)
    resume_config = dataclasses.replace(built.config)
    resume_config.checkpoint = dataclasses.replace(built.config.checkpoint, load=root)
    started = time.perf_counter()
    plan = plan_resume(resume_config, os.path.join(root, "unused_run"), lambda message: None, True, Collectives())
    assert plan is not None, f"no checkpoint found under {root}"
    load_into_run(plan, resume_config, built.parts, lambda message: None)
    load = time.perf_counter() - started
    shutil.rmtree(root)
    return {"bytes": written, "save": save, "load": load}


def trainer_async(built: Built, root: str, iteration: int, tokens: int) -> dict[str, float]:
    """Save through an async Checkpointer while the loop runs one training step; the loop is blocked for the
    save() call and for the wait before its optimizer step (until the pieces are copied aside)."""
    lines: list[str] = []
    checkpointer = Checkpointer(True, lines.append)
    job = build_save_job(root, built.parts, TrainingProgress(iteration), built.config.to_dict(), keep_last=0)
    os.makedirs(root, exist_ok=True)
    started = time.perf_counter()
    checkpointer.save(job)
    call = time.perf_counter() - started
    waited = train_step(built, tokens, checkpointer)
    checkpointer.wait()
    total = time.perf_counter() - started
    # the Checkpointer's own report: "... copied aside in C s): written in W s, ..."
    copy = float(lines[0].split("copied aside in ")[1].split(" s")[0])
    write = float(lines[0].split("written in ")[1].split(" s")[0])
    written = dir_size(root)
    shutil.rmtree(root)
    return {"bytes": written, "call": call, "blocked": call + waited, "copy": copy, "write": write, "total": total}


def dcp_direct(state_dict: dict[str, torch.Tensor], path: str) -> dict[str, float]:
    """dcp.save and dcp.load (into the same tensors) of the plain dict, FileSystemWriter's defaults."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no process group": one process is meant
        save = timed(lambda: dcp.save(state_dict, checkpoint_id=path, no_dist=True))
        written = dir_size(path)
        drop_from_cache(path)
        load = timed(lambda: dcp.load(state_dict, checkpoint_id=path, no_dist=True))
    shutil.rmtree(path)
    return {"bytes": written, "save": save, "load": load}


def torch_save_load(state_dict: dict[str, torch.Tensor], path: str) -> dict[str, float]:
    """torch.save of the plain dict into one file + fsync; torch.load of it (a second copy, freed at once)."""

    def save() -> None:
        with open(path, "wb") as handle:
            torch.save(state_dict, handle)
            handle.flush()
            os.fsync(handle.fileno())

    seconds = timed(save)
    written = os.path.getsize(path)
    drop_from_cache(path)
    load = timed(lambda: torch.load(path, weights_only=True))
    os.remove(path)
    return {"bytes": written, "save": seconds, "load": load}


def best(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Per figure, the best (lowest) over the rounds."""
    return {key: min(r[key] for r in rounds) for key in rounds[0]}


def print_table(disk: dict, trainer: dict, asynchronous: dict, direct: dict, plain: dict) -> None:
    """One row per write or read: bytes, seconds, GB/s and the share of the disk's bandwidth."""
    write_rate, read_rate = disk["bytes"] / disk["write"], disk["bytes"] / disk["read"]
    rows = [
        ("disk: sequential write + fsync", disk["bytes"], disk["write"], write_rate),
        ("disk: sequential read (cache dropped)", disk["bytes"], disk["read"], read_rate),
        ("trainer save (sync Checkpointer)", trainer["bytes"], trainer["save"], write_rate),
        (
            "trainer save (async: copy + write)",
            asynchronous["bytes"],
            asynchronous["copy"] + asynchronous["write"],
            write_rate,
        ),
        ("trainer load (one pass: read + CRC-32)", trainer["bytes"], trainer["load"], read_rate),
        ("dcp.save (plain dict)", direct["bytes"], direct["save"], write_rate),
        ("dcp.load (plain dict)", direct["bytes"], direct["load"], read_rate),
        ("torch.save (one file + fsync)", plain["bytes"], plain["save"], write_rate),
        ("torch.load", plain["bytes"], plain["load"], read_rate),
    ]
    print(f"| {'what':40s} | {'GB':>6s} | {'seconds':>7s} | {'GB/s':>6s} | {'of disk':>7s} |")
    print(f"|{'-' * 42}|{'-' * 8}|{'-' * 9}|{'-' * 8}|{'-' * 9}|")
    for name, size, seconds, disk_rate in rows:
        rate = size / seconds
        print(
            f"| {name:40s} | {size / 1e9:6.2f} | {seconds:7.2f} | {rate / 1e9:6.3f} | {100 * rate / disk_rate:6.0f}% |"
        )
    warm = disk["bytes"] / disk["read_warm"] / 1e9
    print(f"disk read without dropping the page cache: {warm:.3f} GB/s (cold {read_rate / 1e9:.3f})")
    print(
        f"async save: save() returned in {asynchronous['call']:.3f} s; the loop was blocked "
        f"{asynchronous['blocked']:.3f} s in all (the copy aside took {asynchronous['copy']:.2f} s, overlapping "
        f"the step's forward and backward), then written in {asynchronous['write']:.2f} s in the background "
        f"while the step ran ({asynchronous['total']:.2f} s from save() to wait() returning after the step)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/gpt2_355m.yaml", help="the model and precision to save")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every measurement; the best is shown")
    parser.add_argument("--step-tokens", type=int, default=32, help="tokens of the training steps (CPU cost)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder; removed)")
    args = parser.parse_args()
    if args.rounds < 1 or args.step_tokens < 1:
        print(f"--rounds ({args.rounds}) and --step-tokens ({args.step_tokens}) must be >= 1", file=sys.stderr)
        return 2
    config = load_config(args.config, ["model.hidden_dropout=0.0", "model.attention_dropout=0.0"])
    built = build(config)
    train_step(built, args.step_tokens)
    params = sum(p.numel() for p in built.parts.chunks[0].parameters())
    state_dict = plain_state_dict(built)
    state_bytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    print(
        f"model: {params / 1e6:.1f} M parameters, {config.train.precision}; checkpoint tensors "
        f"{state_bytes / 1e9:.2f} GB in {len(state_dict)} tensors"
    )
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)  # removed at the end, also on failure
    results: dict[str, list[dict[str, float]]] = {"disk": [], "trainer": [], "async": [], "dcp": [], "torch": []}
    try:
        for round_index in range(args.rounds):
            iteration = 1 + 2 * round_index
            results["disk"].append(disk_bandwidth(workdir, state_bytes))
            results["trainer"].append(trainer_sync(built, os.path.join(workdir, "trainer"), iteration))
            results["dcp"].append(dcp_direct(state_dict, os.path.join(workdir, "dcp")))
            results["torch"].append(torch_save_load(state_dict, os.path.join(workdir, "plain.pt")))
            results["async"].append(
                trainer_async(built, os.path.join(workdir, "async"), iteration + 1, args.step_tokens)
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(*(best(results[name]) for name in ("disk", "trainer", "async", "dcp", "torch")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
