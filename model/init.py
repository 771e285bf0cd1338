"""Layout-independent initialisation: every parameter is drawn in full from a generator seeded by
(seed, its global name), then cut to the local shard.

So any tensor-parallel size and any pipeline cut gets exactly the weights one process gets, whatever order
ranks build in, and memory peaks at one full weight. `materialize_parameters` is the same cut with the full
tensors taken from elsewhere (a global state dict: convert/model_weights.build_model_from_state). Reads the
parameter's ParamInfo (model/param_info.py): `init_name` (the last stage's copy of a tied embedding seeds from
the embedding's name), `full_shape` and the `sharding` record with the rank's place in its tp group (set by
parallel/'s layers), which cuts the shard.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import nn

from model.config import ModelConfig
from model.param_info import full_shape, param_info

# Megatron draws these at init_std / sqrt(2 x layers): the projections whose output is added to the residual
# stream (attention, the dense MLP, the routed experts' stacked [E, h, f] fc2 and the shared expert's fc2).
OUTPUT_PROJECTION_SUFFIXES = (
    "attention.proj.weight",
    "mlp.fc2.weight",
    "mlp.experts.fc2_weight",
    "mlp.shared_experts.fc2.weight",
)


def scaled_init_std(cfg: ModelConfig) -> float:
    """Megatron's std of the output projections: init_std / sqrt(2 x num_layers)."""
    return cfg.init_std / math.sqrt(2.0 * cfg.num_layers)


def name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from the run seed and a parameter's global name."""
    return int(hashlib.md5(f"{seed}/{name}".encode()).hexdigest()[:15], 16)


def draw_full_parameter(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The fp32 full-size initial value of parameter `name` (Megatron's init rules)."""
    full = torch.empty(shape, dtype=torch.float32)
    if "norm." in name:
        return full.fill_(1.0 if name.endswith("weight") else 0.0)
    if name.endswith((".bias", "_bias")):  # "_bias": the routed experts' stacked fc1_bias [E, f], fc2_bias [E, h]
        return full.zero_()
    std = scaled_init_std(cfg) if name.endswith(OUTPUT_PROJECTION_SUFFIXES) else cfg.init_std
    generator = torch.Generator().manual_seed(name_seed(seed, name))
    return full.normal_(0.0, std, generator=generator)


FullValue = Callable[[str, tuple[int, ...]], torch.Tensor]  # (global name, full shape) -> the full tensor


@torch.no_grad()
def materialize_parameters(
    model: nn.Module, full_value: FullValue, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> None:
    """Replace every parameter (meta or not) of `model` by this rank's shard of `full_value(name, full shape)`
    (name: its ParamInfo.init_name, else its global name) on `device` in `dtype`, keeping its ParamInfo.

    Shared parameters (a tied output layer) are replaced once and stay shared; buffers follow to `device`
    (`materialize_buffers`).
    """
    names = {id(param): name for name, param in model.named_parameters()}
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for local_name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(param) not in replaced:
                info = param_info(param)
                full = full_value(info.init_name or names[id(param)], full_shape(param))
                local = info.local_shard(full)
                new = nn.Parameter(local.to(device=device, dtype=dtype).contiguous(), requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)  # keep the ParamInfo (and anything else set on it)
                replaced[id(param)] = new
            setattr(module, local_name, replaced[id(param)])
    materialize_buffers(model, device)


@torch.no_grad()
def materialize_buffers(model: nn.Module, device: torch.device | str = "cpu") -> None:
    """Move every buffer to `device`, keeping its dtype; one still on the meta device becomes zeros. The
    model's only buffers are the MoE router's (model/moe/layer.py: the expert bias and its selection counts,
    both zero at the start and fp32 whatever the model's dtype)."""
    for module in model.modules():
        for buffer_name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                setattr(module, buffer_name, torch.zeros(buffer.shape, dtype=buffer.dtype, device=device))
            else:
                setattr(module, buffer_name, buffer.to(device))


def initialize_parameters(
    model: nn.Module,
    cfg: ModelConfig,
    seed: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> None:
    """Give every parameter of `model` its deterministic initial value (Megatron's rules, drawn in full from
    (seed, global name), then cut to this rank's shard) on `device`."""
    materialize_parameters(model, lambda name, shape: draw_full_parameter(name, shape, cfg, seed), device, dtype)
