"""What several benchmarks build alike: a dropout-free GPT config (a measurement must not depend on the dropout
RNG), a single GPT with its deterministic initial weights, and the trainer's command line for a short run
without checkpoints or evaluation. Imported by its siblings as `bench_models` (a script's folder is on sys.path).
"""

from __future__ import annotations

import os

import torch

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
    return [
        *launcher,
        os.path.join(REPO_ROOT, "pretrain_gpt.py"),
        *arguments,
        f"train.train_iters={iters}",
        "optim.lr_warmup_iters=1",
        "train.eval_iters=0",
        "checkpoint.save=false",
        "logging.log_interval=1",
        "logging.tensorboard=false",
        f"run.dir={run_dir}",
    ]
