"""Read Megatron-LM's GPT checkpoints into our global state dict: the legacy "torch" format here, the
"torch_dist" format through convert/megatron_dist.py (same names, same args).

    CHECKPOINTS/latest_checkpointed_iteration.txt            iteration number (or "release")
    CHECKPOINTS/iter_0000100/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt
        {"args": argparse.Namespace, "checkpoint_version": 3.0, "iteration": 100, "model": state dict (or
         "model0", "model1", ... with virtual pipeline stages), "optimizer": ..., "opt_param_scheduler": ...,
         "rng_state": [{... "np_rng_state": numpy's RandomState tuple ...}],
         "num_floating_point_operations_so_far": ...}

Two key styles: legacy (`model.language_model.encoder.layers.N.self_attention.query_key_value.weight`,
nested dicts, QKV rows [np, 3, hn], i.e. [ng, np/ng + 2, hn] with grouped-query attention) and megatron-core
(`decoder.layers.N.self_attention.linear_qkv.weight`, rows per query group [ng, np/ng + 2, hn]); both are
our per-group layout. Layer indices are local to a pipeline stage / virtual chunk; tensor-parallel shards
are merged by our own split rule (model/param_info.Sharding per global name: column-parallel rows,
row-parallel columns, SwiGLU fc1 holding [gate_r; up_r] per rank), which is Megatron's.

Files are unpickled with weights_only=True and the allow-list of convert/safe_pickle.py (namespace, numpy
arrays and dtypes, byte buffers; Megatron's own objects become inert placeholders); any other global is
refused by name. Only the model weights are taken; optimizer, scheduler and RNG state are not carried.
Names: the folders in checkpoint/folder_names.py, the tensors in convert/megatron_names.py, the args
in convert/megatron_args.py (each shared with the export, convert/megatron_export.py).
"""

from __future__ import annotations

import argparse
import os
import re

import torch

from checkpoint import (
    ITER_RE,
    MAIN_FILE,
    MP_RANK_PREFIX,
    RELEASE,
    TRACKER,
    iter_name,
    parse_mp_rank,
)
from convert.hf_mapping import UnsupportedModelError
from convert.megatron_args import model_config_from_args, tokenizer_from_args
from convert.megatron_checks import check_args, check_rank_folders, check_shard
from convert.megatron_dist import is_torch_dist, read_common, read_model_tensors
from convert.megatron_names import GLOBAL_TO_OURS, LAYER_TO_OURS
from convert.model_weights import meta_state, resize_vocab_rows
from convert.safe_pickle import load_megatron_file
from model.config import ModelConfig
from model.param_info import Sharding
from parallel.pipeline.stages import StageMap
from parallel.tensor_parallel import param_shardings

Tensors = dict[str, torch.Tensor]
LAYER_KEY = re.compile(
    r"^(?:decoder|encoder|transformer)\.layers\.(\d+)\.(.+)\.(weight|bias|layer_norm_weight|"
    r"layer_norm_bias)$"
)


def find_iteration_dir(root: str) -> str:
    """CHECKPOINTS folder (through its tracker) or an iter_XXXXXXX / release folder."""
    name = os.path.basename(os.path.normpath(root))
    if (ITER_RE.match(name) or name == RELEASE) and os.path.isdir(root):
        return root
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        raise ValueError(f"{root} is not a Megatron-LM checkpoint folder: no {TRACKER} and not an iter_XXXXXXX folder")
    try:
        with open(tracker, encoding="utf-8") as handle:
            text = handle.read(64).strip()  # an iteration number is short; junk is not read whole
    except (OSError, ValueError) as err:  # ValueError: not UTF-8 text
        raise ValueError(f"{tracker} cannot be read as text ({type(err).__name__}): not a Megatron tracker") from None
    folder = RELEASE if text == RELEASE else iter_name(int(text)) if text.isdigit() else None
    if folder is None:
        raise ValueError(
            f"{tracker} holds {text!r}, not an iteration number: write the iteration into it, or name the "
            "iter_XXXXXXX folder itself"
        )
    return os.path.join(root, folder)


def rank_files(iter_dir: str) -> dict[tuple[int, int], str]:
    """{(tp_rank, pp_rank): model_optim_rng.pt path} of every mp_rank folder."""
    files = {}
    for name in sorted(os.listdir(iter_dir)) if os.path.isdir(iter_dir) else []:
        ranks = parse_mp_rank(name)
        if ranks is not None:
            files[ranks] = os.path.join(iter_dir, name, MAIN_FILE)
        elif name.startswith(MP_RANK_PREFIX):
            raise UnsupportedModelError(
                f"{os.path.join(iter_dir, name)}: expert-parallel checkpoints are not supported"
            )
    if not files:
        raise ValueError(f"{iter_dir} holds no mp_rank_* folders and no torch_dist metadata.json")
    return files


def flatten(nested: dict, prefix: str = "") -> Tensors:
    """Legacy nested state dicts ({"language_model": {"encoder": {...}}}) -> dotted names."""
    flat: Tensors = {}
    for key, value in nested.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, torch.Tensor):
            flat[name] = value
    return flat


def rename_chunk(chunk: Tensors, layer_offset: int) -> Tensors:
    """One chunk's tensors under our global names (layer indices shifted by the chunk's first layer)."""
    ours: Tensors = {}
    for name, tensor in chunk.items():
        name = name.removeprefix("language_model.").removeprefix("module.")
        if name.endswith("_extra_state"):
            continue
        if name in GLOBAL_TO_OURS:
            ours[GLOBAL_TO_OURS[name]] = tensor
            continue
        match = LAYER_KEY.match(name)
        module = match and (match.group(2) + (".layer_norm" if match.group(3).startswith("layer_norm") else ""))
        if not match or module not in LAYER_TO_OURS:
            raise UnsupportedModelError(f"Megatron tensor {name} has no counterpart in this model")
        kind = "bias" if match.group(3).endswith("bias") else "weight"
        ours[f"layers.{int(match.group(1)) + layer_offset}.{LAYER_TO_OURS[module]}.{kind}"] = tensor
    return ours


def merge_tp(name: str, shards: list[torch.Tensor], shardings: dict[str, Sharding]) -> torch.Tensor:
    """The full tensor from its tensor-parallel shards (rank order), split as our model splits it."""
    if name not in shardings:
        raise UnsupportedModelError(f"Megatron tensor {name} has no counterpart in this model")
    return shardings[name].merge(shards)


def _chunks(payload: dict, path: str) -> list[Tensors]:
    """The model chunks of one file ("model", or "model0", "model1", ... with virtual pipeline stages)."""
    chunk_keys = (k for k in payload if isinstance(k, str) and re.fullmatch(r"model\d+", k))
    keys = ["model"] if "model" in payload else sorted(chunk_keys, key=lambda k: int(k[5:]))
    if not keys:
        raise ValueError(f"{path} holds no model state (keys: {', '.join(sorted(map(str, payload)))})")
    if not all(isinstance(payload[k], dict) for k in keys):
        raise ValueError(f"{path}: its {', '.join(keys)} entry is not a state dict")
    return [flatten(payload[k]) for k in keys]


def read_args(iter_dir: str) -> tuple[argparse.Namespace, dict]:
    """(Megatron's args, the first payload: a legacy rank file or torch_dist's common.pt), checked."""
    if is_torch_dist(iter_dir):
        path, payload = os.path.join(iter_dir, "common.pt"), read_common(iter_dir)
    else:
        files = rank_files(iter_dir)
        path = files[min(files)]
        payload = load_megatron_file(path)
    args = payload.get("args")
    if not isinstance(args, argparse.Namespace):
        raise ValueError(f"{path} holds no Megatron args")
    check_args(args, path)
    version = payload.get("checkpoint_version", 0)
    if isinstance(version, bool) or not isinstance(version, (int, float)) or version < 2.0:
        raise UnsupportedModelError(
            f"checkpoint_version={payload.get('checkpoint_version')} ([3, np, hn] QKV "
            "order) is not supported; re-save it with Megatron-LM >= 2.0"
        )
    return args, payload


def load_megatron_checkpoint(root: str, vocab_size: int | None = None) -> tuple[ModelConfig, Tensors, dict | None]:
    """(model config, our global state dict, tokenizer keys or None) of a Megatron-LM checkpoint, legacy torch
    format or torch_dist.

    vocab_size: the unpadded vocabulary; default: the size of the tokenizer args name (its files when they
    exist; NullTokenizer: args.vocab_size + 1), else args.vocab_size, else args.padded_vocab_size."""
    iter_dir = find_iteration_dir(root)
    args, first = read_args(iter_dir)
    data, tokenizer_vocab = tokenizer_from_args(args)
    vocab = (
        vocab_size or tokenizer_vocab or getattr(args, "vocab_size", None) or getattr(args, "padded_vocab_size", None)
    )
    if type(vocab) is not int or vocab < 1:
        raise ValueError(f"{iter_dir}: no vocabulary size (args.vocab_size, args.padded_vocab_size or a tokenizer)")
    cfg = model_config_from_args(args, vocab)
    try:
        cfg.validate()
    except ValueError as err:
        raise UnsupportedModelError(
            f"{iter_dir}: Megatron's args describe a model the trainer refuses: {err}"
        ) from None
    if is_torch_dist(iter_dir):
        tensors = rename_chunk(read_model_tensors(iter_dir), 0)
        full, shardings = meta_state(cfg), param_shardings(cfg)
        for name, tensor in tensors.items():  # whole tensors: DCP reassembled the tp shards
            check_shard(name, tensor, os.path.join(iter_dir, ".metadata"), (0, 1), full, shardings)
    else:
        tensors = _legacy_tensors(iter_dir, first, cfg, args)
    _check_complete(tensors, cfg, iter_dir)
    return cfg, _pad_vocab(tensors, cfg), data


def _legacy_tensors(iter_dir: str, first: dict, cfg: ModelConfig, args: argparse.Namespace) -> Tensors:
    """The global tensors of every mp_rank file: layers renumbered across pp stages and virtual chunks
    (chunk c of stage p holds layers [(c * pp + p) * per_chunk, ...)), tp shards merged."""
    files = rank_files(iter_dir)
    tp, pp = check_rank_folders(iter_dir, files, args)
    full, shardings = meta_state(cfg), param_shardings(cfg)
    shards: dict[str, list[torch.Tensor]] = {}
    for (tp_rank, pp_rank), path in sorted(files.items()):
        payload = first if path == files[min(files)] else load_megatron_file(path)
        chunks = _chunks(payload, path)
        stages = StageMap(pp, len(chunks))  # Megatron's interleaving
        for chunk_index, chunk in enumerate(chunks):
            offset = stages.placement(cfg.num_layers, pp_rank, chunk_index).layer_ids[0]
            for name, tensor in rename_chunk(chunk, offset).items():
                check_shard(name, tensor, path, (tp_rank, tp), full, shardings)
                shards.setdefault(name, []).append(tensor)
    return {name: merge_tp(name, parts, shardings) for name, parts in shards.items()}


def _check_complete(tensors: Tensors, cfg: ModelConfig, iter_dir: str) -> None:
    missing = [
        f"layers.{i}.attention.qkv.weight"
        for i in range(cfg.num_layers)
        if f"layers.{i}.attention.qkv.weight" not in tensors
    ]
    for name in ("embedding.word_embeddings.weight", "final_norm.weight"):
        if name not in tensors:
            missing.append(name)
    if missing:
        raise ValueError(f"{iter_dir}: tensor {missing[0]} not found ({len(missing)} missing)")
    rows, vocab = tensors["embedding.word_embeddings.weight"].shape[0], cfg.vocab_size or 0
    if rows < vocab:  # zero rows would be invented for the tokenizer's last ids
        raise ValueError(
            f"{iter_dir}: the embedding has {rows} rows but the vocabulary (its tokenizer or args.vocab_size) has "
            f"{vocab} entries: the tokenizer the args name is not the model's"
        )


def _pad_vocab(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    """Vocabulary rows cut to the real vocabulary and zero-padded to our padded size (tied: one table)."""
    tensors = resize_vocab_rows(tensors, cfg, cfg.padded_vocab_size(1))
    if cfg.tie_embeddings:
        tensors["output_layer.weight"] = tensors["embedding.word_embeddings.weight"]
    return tensors
