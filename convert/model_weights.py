"""A model's weights as one global state dict, from and to our checkpoints, and as a runnable model.

The global state dict is what a single-process GPTModel holds (`layers.5.mlp.fc1.weight`, the vocabulary
padded to ModelConfig.padded_vocab_size(1)); the converters (tools/convert_checkpoint.py) work on it, so that
any checkpoint layout is read in one place. place_global_weights gives a model's chunks at any layout their
shards of it (a transformers folder opened by convert/open_model.py, the one door that opens a model).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from checkpoint import load_model_weights, read_saved_config, resolve_checkpoint, save_model_weights
from config.data_config import DataConfig, resolve_data_file
from config.schema import ParallelConfig, TrainConfig, config_from_dict
from model.config import ModelConfig
from model.gpt import GPTModel
from model.init import materialize_parameters
from model.param_info import full_shape, param_info
from model.rank_spec import RankSpec
from parallel.layout import build_layout
from parallel.model_builder import build_model_chunks, rank_spec
from parallel.state import ParallelState
from parallel.tensor_parallel import param_shardings

Tensors = dict[str, torch.Tensor]


def load_global_state(path: str) -> tuple[dict, Tensors]:
    """(saved config dict, global state dict) of a checkpoint of any layout (checkpoints folder or iter folder),
    read through the layout-free loader at layout 1. Relative tokenizer files in the saved config are
    resolved against the checkpoint root (the folder holding iter_XXXXXXX), where the converters copy them."""
    iter_dir = resolve_checkpoint(path)
    config = read_run_config(iter_dir)
    state = ParallelState.single()
    model = config_from_dict(config).model
    chunks = checkpoint_chunks(iter_dir, model, state, 0, torch.device("cpu"), torch.float32, rank_spec(model, state))
    tensors = chunks[0].state_dict()
    check_finite(tensors, iter_dir)
    return config, tensors


def checkpoint_chunks(
    iter_dir: str,
    cfg: ModelConfig,
    state: ParallelState,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    spec: RankSpec,
) -> list[GPTModel]:
    """This rank's chunks at `state` holding the weights of the checkpoint in `iter_dir`, read through the
    layout-free loader (collective when distributed; `seed` only draws the initial values it overwrites)."""
    chunks = build_model_chunks(cfg, state, seed, device, dtype, spec)
    load_model_weights(iter_dir, chunks, state)
    return chunks


def read_run_config(iter_dir: str) -> dict:
    """The run config saved with a checkpoint's iteration folder, its relative tokenizer files resolved
    against the checkpoint root (the folder holding iter_XXXXXXX), where the converters copy them."""
    config = read_saved_config(iter_dir)
    data = config.get("data") or {}
    for key in DataConfig.FILE_KEYS:
        path = data.get(key)
        if isinstance(path, str):  # None stays None
            data[key] = resolve_data_file(path, os.path.dirname(iter_dir), base_first=True)
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


# The floating-point types a weight file may hold (converted to the checkpoint's fp32 on load).
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_dtypes(tensors: Tensors, source: str) -> None:
    """ValueError naming `source` and the first tensor that is not fp32 / bf16 / fp16 / fp64: integers or
    booleans would be converted to weights silently, fp8 needs scales this project does not read."""
    for name, tensor in tensors.items():
        if tensor.dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"{source}: tensor {name} holds {str(tensor.dtype).removeprefix('torch.')} values, not weights in "
                "fp32, bf16, fp16 or fp64: the file is damaged or quantized; use an unquantized export"
            )


def meta_state(cfg: ModelConfig) -> Tensors:
    """cfg's global state dict as meta tensors: the shape of every parameter (vocabulary tables padded to
    padded_vocab_size(1)) without memory, to check weights against before mapping them."""
    with torch.device("meta"):
        return dict(GPTModel(cfg, cfg.padded_vocab_size(1)).state_dict())


def check_layout(cfg: ModelConfig, tp: int, pp: int, vp: int) -> ParallelConfig:
    """The parallel section of a conversion to (tp, pp, vp), checked by the trainer's own rules
    (parallel/layout.py): a layout the trainer would refuse is refused with the trainer's message."""
    if cfg.qk_layernorm and tp > 1:  # the model build refuses it too; say so before anything is written
        raise ValueError(f"model.qk_layernorm=true needs parallel.tp_size=1, got {tp}")
    parallel = ParallelConfig(tp_size=tp, pp_size=pp, vp_size=vp, schedule="interleaved" if vp > 1 else "1f1b")
    build_layout(cfg, parallel, TrainConfig(micro_batch_size=1, global_batch_size=pp), world_size=tp * pp)
    return parallel


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
    """A whole model (pre and post process) holding `tensors`, sharded over state's tp group, in eval mode:
    built on the meta device from the rank's description, then filled by place_global_weights."""
    state = state or ParallelState.single()
    with torch.device("meta"):
        model = GPTModel(cfg, cfg.padded_vocab_size(state.tp_size), spec=rank_spec(cfg, state))
    place_global_weights([model], tensors, cfg, device, dtype)
    return model.eval()


@torch.no_grad()
def place_global_weights(
    chunks: Sequence[nn.Module], tensors: Tensors, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype
) -> None:
    """Give every parameter of `chunks` (meta or not) its shard of the global state dict `tensors` (the cut
    model/init.py makes of an initial value), vocabulary tables padded to the chunks' rows, on `device` in
    `dtype`. Checked first: ValueError naming the first tensor the model lacks or does not hold, or whose
    shape differs."""
    shardings = param_shardings(cfg)
    unexpected = sorted(tensors.keys() - meta_state(cfg).keys())
    shapes = {}  # global name -> the full shape this layout holds it at (vocabulary rows padded to the layout)
    for chunk in chunks:
        for name, param in chunk.named_parameters(remove_duplicate=False):
            shapes[param_info(param).init_name or name] = full_shape(param)
    missing = sorted(shapes.keys() - tensors.keys())
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"holds {unexpected[0]}, which the model does not have"
        raise ValueError(f"the weights do not fit the model config: the state dict {what}")
    padded = {name: shardings[name].padded(tensors[name], shape[0]) for name, shape in shapes.items()}
    for name, shape in shapes.items():
        if tuple(padded[name].shape) != shape:
            raise ValueError(
                f"the weights do not fit the model config: {name} is {tuple(padded[name].shape)}, the model's {shape}"
            )
    for chunk in chunks:
        materialize_parameters(chunk, lambda name, shape: padded[name].to(torch.float32), device, dtype)
