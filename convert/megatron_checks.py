"""Checks of a Megatron-LM checkpoint against its own args before its tensors are merged (convert/megatron.py):
the mp_rank folders against the tp x pp the args record, the model sizes the args must hold, each tensor's
dtype and shard shape against the model the args describe. Each failure is one line naming the file."""

from __future__ import annotations

import argparse
import os

import torch

from checkpoint import mp_rank_name
from convert.hf_mapping import UnsupportedModelError
from convert.model_weights import check_dtypes
from model.param_info import Sharding

Tensors = dict[str, torch.Tensor]


def check_rank_folders(iter_dir: str, files: dict[tuple[int, int], str], args: argparse.Namespace) -> tuple[int, int]:
    """(tp, pp) of the mp_rank folders, checked against the sizes Megatron's args record (else the folders'
    own largest ranks): an unexpected folder or a missing one is named."""
    tp, pp = (getattr(args, key, None) for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"))
    tp = tp if type(tp) is int and tp >= 1 else max(k[0] for k in files) + 1
    pp = pp if type(pp) is int and pp >= 1 else max(k[1] for k in files) + 1
    expected = {(t, p) for t in range(tp) for p in range(pp)}
    extra = sorted(set(files) - expected)
    if extra:
        raise ValueError(
            f"{os.path.dirname(files[extra[0]])} is unexpected: the args say tp={tp} x pp={pp}; move it out of "
            f"{iter_dir} (it belongs to another checkpoint)"
        )
    missing = sorted(expected - set(files))
    if missing:
        name = mp_rank_name(*missing[0], name_pp_rank=pp > 1)
        raise ValueError(
            f"{iter_dir} misses {name} ({len(missing)} of the {len(expected)} mp_rank folders of tp={tp} x pp={pp} "
            "missing): the checkpoint is incomplete; copy it again"
        )
    return tp, pp


def check_args(args: argparse.Namespace, path: str) -> None:
    """The model sizes every conversion needs, present as whole numbers >= 1 (one line naming the file)."""
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        value = getattr(args, key, None)
        if type(value) is not int or value < 1:
            raise ValueError(f"{path}: Megatron args.{key} is {value!r}, not a whole number >= 1")


def check_shard(
    name: str,
    tensor: torch.Tensor,
    path: str,
    tp_rank_size: tuple[int, int],
    full: Tensors,
    shardings: dict[str, Sharding],
) -> None:
    """ValueError naming the file when one of its tensors is not a weight of the model its args describe: a
    dtype other than fp32 / bf16 / fp16 / fp64, or a shape other than its tp shard's (a short or damaged
    weight). `full`: the model's global tensors on the meta device (convert/model_weights.meta_state), split as
    `shardings` say; vocabulary tables are checked past their rows, whose padding Megatron chose."""
    check_dtypes({name: tensor}, path)
    if name not in full:
        raise UnsupportedModelError(f"{path}: Megatron tensor {name} has no counterpart in the model its args describe")
    sharding = shardings[name]
    want = tuple(sharding.shard(full[name], *tp_rank_size).shape)
    got = tuple(tensor.shape)
    if got != want and not (sharding.valid_rows is not None and got[1:] == want[1:]):
        raise ValueError(
            f"{path}: tensor {name} is {list(got)} but the model its args describe holds {list(want)} on tp rank "
            f"{tp_rank_size[0]} of {tp_rank_size[1]}: the file is damaged or its args are not its own"
        )
