"""What the trainer knows about each parameter, in one typed record: `ParamInfo`.

model/ creates parameters; parallel/ shards them and training/ reduces, clips, initialises and saves them.
The facts they exchange live on the parameter as one attribute, `param.ptdp` (a ParamInfo), read through
`param_info(param)` (a default record for a parameter nobody annotated) and changed through
`set_param_info(param, **fields)`. Being in the parameter's __dict__, the record survives deepcopy and
is carried over when model/init.py or parallel/ replace a parameter by a new one.

Fields:
    init_name          the global name init seeds from and checkpoints store under when it differs from
                       the module path (the last stage's copy of a tied embedding: the embedding's name)
    full_shape         the unsharded shape (None: the parameter is not sharded, its own shape)
    shard_fn           full tensor -> this rank's shard (None: not sharded)
    tensor_parallel    True: sharded over tp; False: replicated on every tp rank
    partition_dim      the dim split over tp (-1 when replicated)
    sequence_parallel  replicated over tp but each tp rank saw only s/tp tokens: its gradient is partial
                       and is summed over tp after backward (norms under sequence parallelism)
    shared_embedding   a tied word embedding split over pipeline stages: its gradient is summed over the
                       embedding group (both the first stage's table and the last stage's copy)
    embedding_copy     the last stage's copy of the tied embedding: counted in neither the gradient norm
                       nor the parameter count (the first stage counts it)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

ATTRIBUTE = "ptdp"


@dataclass(frozen=True)
class ParamInfo:
    """The per-parameter facts shared by model/, parallel/ and training/ (see the module docstring)."""

    init_name: str | None = None
    full_shape: tuple[int, ...] | None = None
    shard_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    tensor_parallel: bool = False
    partition_dim: int = -1
    sequence_parallel: bool = False
    shared_embedding: bool = False
    embedding_copy: bool = False


_DEFAULT = ParamInfo()


def param_info(param: torch.Tensor) -> ParamInfo:
    """The parameter's record (the default record when none was set)."""
    return getattr(param, ATTRIBUTE, _DEFAULT)


def set_param_info(param: torch.Tensor, **fields) -> ParamInfo:
    """Replace the given fields of the parameter's record; returns the new record."""
    info = dataclasses.replace(param_info(param), **fields)
    setattr(param, ATTRIBUTE, info)
    return info


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape of `param`."""
    shape = param_info(param).full_shape
    return tuple(param.shape) if shape is None else tuple(shape)
