"""A model's weights as one global state dict, from and to our checkpoints, and as a runnable model.

The global state dict is what a single-process GPTModel holds (`layers.5.mlp.fc1.weight`, the vocabulary
padded to ModelConfig.padded_vocab_size(1)); the converters (tools/convert_checkpoint.py) and generation
(tools/generate.py) work on it, so that any checkpoint layout is read in one place.
"""

from __future__ import annotations

import os

import torch

from config.data_config import DataConfig, resolve_data_file
from config.schema import config_from_dict
from model.config import ModelConfig
from model.gpt import GPTModel
from parallel.model_builder import build_model_chunks
from parallel.state import ParallelState
from parallel.tensor_parallel import apply_tensor_parallel, param_shardings, tensor_parallel_hooks, tp_comm
from training.checkpointing import load_model_weights, read_saved_config, resolve_checkpoint, save_model_weights

Tensors = dict[str, torch.Tensor]


def load_global_state(path: str) -> tuple[dict, Tensors]:
    """(saved config dict, global state dict) of a checkpoint of any layout (checkpoints folder or iter folder),
    read through the layout-free loader at layout 1. Relative tokenizer files in the saved config are
    resolved against the checkpoint root (the folder holding iter_XXXXXXX), where the converters copy them."""
    iter_dir = resolve_checkpoint(path)
    config = read_run_config(iter_dir)
    state = ParallelState.single()
    chunks = build_model_chunks(
        config_from_dict(config).model, state, seed=0, device=torch.device("cpu"), dtype=torch.float32
    )
    load_model_weights(iter_dir, chunks, state)
    tensors = chunks[0].state_dict()
    check_finite(tensors, iter_dir)
    return config, tensors


def read_run_config(iter_dir: str) -> dict:
    """The run config saved with a checkpoint's iteration folder, its relative tokenizer files resolved
    against the checkpoint root (the folder holding iter_XXXXXXX), where the converters copy them."""
    config = read_saved_config(iter_dir)
    data = config.get("data") or {}
    for key in DataConfig.FILE_KEYS:
        if key in data:
            data[key] = resolve_data_file(data[key], os.path.dirname(iter_dir), base_first=True)
    return config


def check_finite(tensors: Tensors, source: str) -> None:
    """ValueError naming `source` and the first tensor holding NaN or inf: such weights generate garbage (or
    fail deep in sampling) and convert into a checkpoint that only looks fine."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(
                f"{source}: tensor {name} holds non-finite values (NaN or inf): these weights are broken (a "
                f"diverged run or a bad export); use another checkpoint or model"
            )


def checkpoint_iteration(path: str) -> tuple[int, str]:
    """(iteration, iteration folder) a checkpoint path resolves to (iter_0000120 -> 120)."""
    iter_dir = resolve_checkpoint(path)
    digits = os.path.basename(iter_dir).removeprefix("iter_")
    return (int(digits) if digits.isdigit() else 0), iter_dir


def loaded_iteration(path: str) -> str:
    """Which iteration a checkpoint path resolves to, as words for the user ("iteration 120 of DIR")."""
    iteration, iter_dir = checkpoint_iteration(path)
    return f"iteration {iteration} of {iter_dir}"


def save_global_state(root: str, iteration: int, config: dict, tensors: Tensors) -> str:
    """A weights-only checkpoint of a global state dict under root (loadable at any layout, e.g. with
    checkpoint.finetune=ROOT); returns the iteration folder."""
    state = ParallelState.single()
    chunks = build_model_chunks(
        config_from_dict(config).model, state, seed=0, device=torch.device("cpu"), dtype=torch.float32
    )
    chunks[0].load_state_dict(tensors)
    return save_model_weights(root, iteration, chunks, state, config)


def resize_vocab_rows(tensors: Tensors, cfg: ModelConfig, padded_vocab: int) -> Tensors:
    """The vocabulary tables cut to the real vocabulary and zero-padded to `padded_vocab` rows (padding rows
    never score); which tensors are tables, their Sharding's valid rows say."""
    shardings = param_shardings(cfg)
    return {name: shardings[name].padded(t, padded_vocab) for name, t in tensors.items()}


def build_model_from_state(
    cfg: ModelConfig,
    tensors: Tensors,
    state: ParallelState | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> GPTModel:
    """A whole model (pre and post process) holding `tensors`, sharded over state's tp group, in eval mode."""
    state = state or ParallelState.single()
    model = GPTModel(cfg, cfg.padded_vocab_size(state.tp_size), tp_hooks=tensor_parallel_hooks(tp_comm(state)))
    model.load_state_dict(resize_vocab_rows(tensors, cfg, cfg.padded_vocab_size(state.tp_size)))
    model = apply_tensor_parallel(model, state)
    model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()
