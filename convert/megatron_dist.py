"""Read Megatron-LM's `torch_dist` checkpoints (megatron.core.dist_checkpointing) with
torch.distributed.checkpoint alone: no Megatron install, one process, any tp / pp / vp it was saved with.

    iter_0000100/metadata.json     {"sharded_backend": "torch_dist", ...}
    iter_0000100/common.pt         what every rank shares: args, iteration, checkpoint_version, ...
    iter_0000100/.metadata         DCP's index: every key's global shape and where its chunks lie
    iter_0000100/__R_N.distcp      the chunks

Model tensors are stored whole (global shapes): tp shards are chunks of one tensor, so DCP reassembles them;
layers are stacked along a leading dimension (`decoder.layers.self_attention.linear_qkv.weight`
[num_layers, ...]), whatever pp / vp split them. The input norms go under Transformer Engine's fused names
(`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`); SwiGLU's fc1 is [gate; up] globally, as ours.
Optimizer state, RNG state and `_extra_state` (pickled byte objects) are never read (nor unpickled).
"""

from __future__ import annotations

import json
import os
import re

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from convert.safe_pickle import load_megatron_file
from training.checkpoint.safe_reader import SafeFileSystemReader

Tensors = dict[str, torch.Tensor]
# A stacked layer tensor's key: the layer-local module path and the parameter.
STACKED_KEY = re.compile(r"^(decoder|encoder)\.layers\.(\D.*)\.(weight|bias|layer_norm_weight|layer_norm_bias)$")


def is_torch_dist(iter_dir: str) -> bool:
    """Whether iter_dir is a dist_checkpointing folder in the torch_dist backend."""
    path = os.path.join(iter_dir, "metadata.json")
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as handle:
        backend = json.load(handle).get("sharded_backend")
    if backend != "torch_dist":
        raise ValueError(f"{iter_dir}: dist_checkpointing backend {backend!r} is not supported (only torch_dist)")
    return True


def read_common(iter_dir: str) -> dict:
    """common.pt: the state every rank shares (args, iteration, checkpoint_version), unpickled safely."""
    path = os.path.join(iter_dir, "common.pt")
    if not os.path.isfile(path):
        raise ValueError(f"{iter_dir} is a torch_dist checkpoint without common.pt")
    return load_megatron_file(path)


def is_model_key(key: str, global_names: dict[str, str]) -> bool:
    """Model weights: the global tensors and the stacked layer tensors (optimizer keys have a prefix)."""
    return key in global_names or STACKED_KEY.match(key) is not None


def read_model_tensors(iter_dir: str, global_names: dict[str, str]) -> Tensors:
    """Every model tensor in full, stacked layers unstacked to `decoder.layers.N.<module>.<param>`."""
    reader = SafeFileSystemReader(iter_dir)  # `.metadata` through the allow-list, read once
    entries = reader.read_metadata().state_dict_metadata
    wanted = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in entries.items()
        if isinstance(entry, TensorStorageMetadata) and is_model_key(key, global_names)
    }
    if not wanted:
        raise ValueError(f"{iter_dir} holds no GPT model tensors (keys: {', '.join(sorted(entries)[:5])}, ...)")
    dcp.load(wanted, storage_reader=reader, no_dist=True)
    flat: Tensors = {}
    for key, tensor in wanted.items():
        match = STACKED_KEY.match(key)
        if match is None:
            flat[key] = tensor
            continue
        for layer in range(tensor.shape[0]):  # [num_layers, ...] -> one tensor per layer
            flat[f"decoder.layers.{layer}.{match.group(2)}.{match.group(3)}"] = tensor[layer].clone()
    return flat
