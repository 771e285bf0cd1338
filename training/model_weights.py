"""A model's weights as one global state dict, from and to our checkpoints, and as a runnable model.

The global state dict is what a single-process GPTModel holds (`layers.5.mlp.fc1.weight`, the vocabulary
padded to ModelConfig.padded_vocab_size(1)); the converters (tools/convert_checkpoint.py) and generation
(tools/generate.py) work on it, so that any checkpoint layout is read in one place.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from model.config import ModelConfig
from model.gpt import GPTModel
from parallel.state import ParallelState
from parallel.tensor_parallel import apply_tensor_parallel
from training.checkpointing import CheckpointError, atomic_save, atomic_write_text, read_tracker, TRACKER, ALIAS

Tensors = dict[str, torch.Tensor]
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def resolve_checkpoint(path: str) -> str:
    """A checkpoints folder (-> its latest complete iteration) or one iter_XXXXXXX folder -> the iter folder."""
    if os.path.basename(os.path.normpath(path)).startswith("iter_") and os.path.isdir(path):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist or is not a folder")
    iteration = read_tracker(path)
    if iteration is None:
        raise CheckpointError(f"{path} is not a checkpoint: no {TRACKER} and not an iter_XXXXXXX folder")
    return os.path.join(path, f"iter_{iteration:07d}")


def _rank_files(iter_dir: str) -> list[str]:
    names = sorted(n for n in os.listdir(iter_dir) if n.startswith("mp_rank_")) if os.path.isdir(iter_dir) else []
    if not names:
        raise CheckpointError(f"checkpoint {iter_dir} holds no mp_rank_* folders")
    return [os.path.join(iter_dir, n, "model_optim_rng.pt") for n in names]


def _load(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # unpickling errors have many types; name the file either way
        raise CheckpointError(f"checkpoint file {path} cannot be read: {str(err).splitlines()[0]}") from None


def read_saved_config(iter_dir: str) -> dict:
    """The run's config (Config.to_dict() form) saved in the checkpoint."""
    return _load(_rank_files(iter_dir)[0])["config"]


def load_global_state(path: str) -> tuple[dict, Tensors]:
    """(saved config dict, global state dict) of a checkpoint (folder or iter folder)."""
    iter_dir = resolve_checkpoint(path)
    files = _rank_files(iter_dir)
    first = _load(files[0])
    if first.get("layout", {}).get("tp", 1) != 1:
        raise CheckpointError(f"checkpoint {iter_dir} was saved with tensor parallelism {first['layout']}; "
                              "reading it needs the layout-free checkpoint loader")
    tensors: Tensors = {}
    for file in files:  # tp = 1: every pipeline stage and chunk holds its tensors under global names
        for chunk_state in _load(file)["model"]:
            tensors.update(chunk_state)
    config = first["config"]
    if config["model"].get("tie_embeddings") and "output_layer.weight" not in tensors:
        tensors["output_layer.weight"] = tensors["embedding.word_embeddings.weight"]
    return config, tensors


def save_global_state(root: str, iteration: int, config: dict, tensors: Tensors) -> str:
    """Write a weights-only checkpoint (layout 1) of a global state dict under root; returns the iter folder."""
    directory = os.path.join(root, f"iter_{iteration:07d}", "mp_rank_00_000")
    os.makedirs(directory, exist_ok=True)
    payload = {"iteration": iteration, "consumed_samples": 0, "skipped_iters": 0, "config": config,
               "model": [dict(tensors)], "lr_schedule": None, "optimizer": None,
               "layout": {"tp": 1, "pp": 1, "vp": 1}}
    atomic_save(payload, os.path.join(directory, "model_optim_rng.pt"))
    atomic_write_text(f"{iteration}\n", os.path.join(root, TRACKER))
    atomic_write_text(f"{iteration}\n", os.path.join(root, ALIAS))
    return os.path.dirname(directory)


def resize_vocab_rows(tensors: Tensors, cfg: ModelConfig, padded_vocab: int) -> Tensors:
    """The vocabulary tables cut or zero-padded to `padded_vocab` rows (padding rows never score)."""
    out = dict(tensors)
    for name in VOCAB_ROWS:
        if name in out:
            rows = out[name][:cfg.vocab_size]
            pad = rows.new_zeros(padded_vocab - rows.shape[0], *rows.shape[1:])
            out[name] = torch.cat([rows, pad]) if pad.shape[0] else rows
    return out


def build_model_from_state(cfg: ModelConfig, tensors: Tensors, state: Optional[ParallelState] = None,
                           device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> GPTModel:
    """A whole model (pre and post process) holding `tensors`, sharded over state's tp group, in eval mode."""
    state = state or ParallelState.single()
    model = GPTModel(cfg, cfg.padded_vocab_size(state.tp_size))
    model.load_state_dict(resize_vocab_rows(tensors, cfg, cfg.padded_vocab_size(state.tp_size)))
    model = apply_tensor_parallel(model, state)
    model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()
