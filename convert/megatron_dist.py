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
import math
import os
import re

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from checkpoint import CheckpointError, SafeFileSystemReader, check_storage_extents
from convert.megatron_names import GLOBAL_TO_OURS
from convert.safe_pickle import first_line, load_megatron_file

Tensors = dict[str, torch.Tensor]
# A stacked layer tensor's key: the layer-local module path and the parameter.
STACKED_KEY = re.compile(r"^(decoder|encoder)\.layers\.(\D.*)\.(weight|bias|layer_norm_weight|layer_norm_bias)$")


def is_torch_dist(iter_dir: str) -> bool:
    """Whether iter_dir is a dist_checkpointing folder in the torch_dist backend."""
    path = os.path.join(iter_dir, "metadata.json")
    if not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as handle:
            backend = json.load(handle)["sharded_backend"]
    except (OSError, ValueError, KeyError, TypeError):  # not JSON, not an object, no backend
        raise ValueError(
            f"{path} is not dist_checkpointing's metadata.json (a JSON object naming sharded_backend): damaged?"
        ) from None
    if backend != "torch_dist":
        raise ValueError(f"{iter_dir}: dist_checkpointing backend {backend!r} is not supported (only torch_dist)")
    return True


def read_common(iter_dir: str) -> dict:
    """common.pt: the state every rank shares (args, iteration, checkpoint_version), unpickled safely."""
    path = os.path.join(iter_dir, "common.pt")
    if not os.path.isfile(path):
        raise ValueError(f"{iter_dir} is a torch_dist checkpoint without common.pt")
    return load_megatron_file(path)


def read_index(reader: dcp.FileSystemReader, iter_dir: str) -> Metadata:
    """reader.read_metadata() with any failure one line naming the `.metadata` file: a flipped byte surfaces
    as many exception types (unpickling, decoding, DCP's own), not all of which name it."""
    path = os.path.join(iter_dir, ".metadata")
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing: the checkpoint is incomplete; copy it again")
    try:
        return reader.read_metadata()
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        message = first_line(err)
        if path in message:  # the reader's own refusal (CheckpointError) names it already
            raise ValueError(message) from None
        raise ValueError(f"{path} cannot be read ({message}): the checkpoint is damaged; copy it again") from None


def dcp_failure(err: BaseException) -> BaseException:
    """The exception behind a CheckpointException (DCP wraps each rank's), else err itself."""
    failures = getattr(err, "failures", None) if isinstance(err, CheckpointException) else None
    return next(iter(failures.values()))[0] if failures else err


def check_index(iter_dir: str, metadata: Metadata, model: dict[str, TensorStorageMetadata]) -> None:
    """What the `.metadata` index says about the model tensors, checked before DCP reads (or memory is allocated
    for) them: a flipped byte in a chunk's offset or size would otherwise read other bytes or leave values
    unset without a word. Each tensor's chunks lie inside its shape and hold exactly its values; each storage
    entry is a file of iter_dir with an extent inside it; the tensors fit in the files' bytes. One line naming
    the file otherwise."""
    path = os.path.join(iter_dir, ".metadata")
    try:
        wanted_bytes = 0
        for key, entry in model.items():
            shape, volume = list(entry.size), 0
            for chunk in entry.chunks:
                ends = [offset + size for offset, size in zip(chunk.offsets, chunk.sizes)]
                if (
                    len(ends) != len(shape)
                    or min(chunk.offsets, default=0) < 0
                    or any(end > size for end, size in zip(ends, shape))
                ):
                    raise ValueError(f"a chunk of {key} at {list(chunk.offsets)} lies outside its shape {shape}")
                volume += math.prod(chunk.sizes)
            if volume != math.prod(shape):
                raise ValueError(f"the chunks of {key} hold {volume} values, its shape {shape} {math.prod(shape)}")
            wanted_bytes += volume * entry.properties.dtype.itemsize
        names = {info.relative_path for info in (metadata.storage_data or {}).values()}  # plain names: the reader
        check_storage_extents(iter_dir, metadata)  # a missing or truncated __R_N.distcp named
    except CheckpointError as err:  # a file cut short, or an extent in the index changed by the damage
        raise ValueError(f"{err}, or {path} is damaged: copy the checkpoint again") from None
    except (ValueError, AttributeError, TypeError) as err:  # a field renamed or retyped by the damage, too
        raise ValueError(f"{path} is damaged ({first_line(err)}): copy the checkpoint again") from None
    stored = sum(os.path.getsize(os.path.join(iter_dir, name)) for name in names)
    if wanted_bytes > stored:
        raise ValueError(f"{path} is damaged: its model tensors need {wanted_bytes} bytes, its files hold {stored}")


def is_model_key(key: str) -> bool:
    """Model weights: the global tensors and the stacked layer tensors (optimizer keys have a prefix)."""
    return key in GLOBAL_TO_OURS or STACKED_KEY.match(key) is not None


def read_model_tensors(iter_dir: str) -> Tensors:
    """Every model tensor in full, stacked layers unstacked to `decoder.layers.N.<module>.<param>`."""
    reader = SafeFileSystemReader(iter_dir)  # `.metadata` through the allow-list, read once
    metadata = read_index(reader, iter_dir)
    entries = metadata.state_dict_metadata
    model = {
        key: entry for key, entry in entries.items() if isinstance(entry, TensorStorageMetadata) and is_model_key(key)
    }
    if not model:
        raise ValueError(f"{iter_dir} holds no GPT model tensors (keys: {', '.join(sorted(entries)[:5])}, ...)")
    check_index(iter_dir, metadata, model)
    wanted = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in model.items()}
    try:
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise ValueError(
            f"{os.path.join(iter_dir, '.metadata')} or a .distcp file beside it is damaged (the tensors cannot be "
            f"read: {first_line(dcp_failure(err))}): copy the checkpoint again"
        ) from None
    flat: Tensors = {}
    for key, tensor in wanted.items():
        match = STACKED_KEY.match(key)
        if match is None:
            flat[key] = tensor
            continue
        for layer in range(tensor.shape[0]):  # [num_layers, ...] -> one tensor per layer
            flat[f"decoder.layers.{layer}.{match.group(2)}.{match.group(3)}"] = tensor[layer].clone()
    return flat
