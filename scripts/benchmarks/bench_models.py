"""What several benchmarks build alike: a dropout-free GPT config (a measurement must not depend on the dropout
RNG), a single GPT with its deterministic initial weights, the trainer's command line for a short run
without checkpoints or evaluation, and the environment torchrun gives a forked rank. Imported by its siblings as `bench_models` (a script's folder is on sys.path).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from multiprocessing.queues import SimpleQueue

import torch
import torch.multiprocessing as mp

from model.config import ModelConfig
from model.gpt import GPTModel
from model.init import initialize_parameters

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model_config(layers: int, hidden: int, heads: int, seq_length: int, vocab_size: int) -> ModelConfig:
    """A GPT config of this size with dropout 0, every other field at its default."""
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        seq_length=seq_length,
        vocab_size=vocab_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def tied_gpt(
    cfg: ModelConfig, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> GPTModel:
    """One whole GPT (no parallelism) built on meta, initialised as the trainer does, output layer tied."""
    with torch.device("meta"):
        model = GPTModel(cfg, cfg.padded_vocab_size())
    initialize_parameters(model, cfg, seed=seed, device=device, dtype=dtype)
    return model


def trainer_argv(launcher: list[str], arguments: list[str], iters: int, run_dir: str) -> list[str]:
    """The command line of a short trainer run: `launcher` (python, or torchrun with its options), then
    pretrain_gpt.py with `arguments`, `iters` iterations logged each, no evaluation, no checkpoint, no
    TensorBoard, its config.yaml and metrics.jsonl written into `run_dir`."""
    return [*launcher, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *arguments, *short_run(iters, run_dir)]


def short_run(iters: int, run_dir: str) -> list[str]:
    """The overrides of a short run: `iters` iterations logged each, no evaluation, no checkpoint, no TensorBoard,
    written into `run_dir`."""
    return [
        f"train.train_iters={iters}",
        "optim.lr_warmup_iters=1",
        "train.eval_iters=0",
        "checkpoint.save=false",
        "logging.log_interval=1",
        "logging.tensorboard=false",
        f"run.dir={run_dir}",
    ]


def set_rank_environment(rank: int, world_size: int, port: int) -> None:
    """The environment torchrun gives a rank (tests/conftest.py's _rank_entry sets the same for tests)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )


def fork_ranks(fn: Callable[..., None], world_size: int, *args: object) -> SimpleQueue:
    """Run `fn(rank, world_size, port, *args, results)` on `world_size` forked ranks (a free port for their
    process group) until they end; returns `results`, the queue they put their figures in (small ones)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.get_context("fork").SimpleQueue()
    mp.start_processes(fn, args=(world_size, port, *args, results), nprocs=world_size, start_method="fork")
    return results
