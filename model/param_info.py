"""What the trainer knows about each parameter, in two typed records: `Sharding` and `ParamInfo`.

`Sharding` is the one rule of how a global tensor is split over tensor-parallel ranks and which of its rows
are real: the layer that shards declares it (parallel/tp_layers.py: split dim and stacked parts), the model
declares the real vocabulary rows of its padded tables (model/gpt.py), and everyone else derives from it:
initialisation cuts the full tensor to the local shard, the checkpoint places the shard in the global tensor
without padding rows, and the converters trim, pad and merge (parallel/tensor_parallel.param_shardings gives
the record per global name for a ModelConfig, without a live model).

model/ creates parameters; parallel/ shards them and training/ reduces, clips, initialises and saves them.
The facts they exchange live on the parameter as one attribute, `param.ptdp` (a ParamInfo), read through
`param_info(param)` (a default record for a parameter nobody annotated) and changed through
`set_param_info(param, **fields)`. Being in the parameter's __dict__, the record survives deepcopy and
is carried over when model/init.py or parallel/ replace a parameter by a new one.

ParamInfo fields:
    init_name          the global name init seeds from and checkpoints store under when it differs from
                       the module path (the last stage's copy of a tied embedding: the embedding's name)
    full_shape         the unsharded shape (None: the parameter is not sharded, its own shape)
    sharding           how the global tensor is split over tp and which rows are real (a `Sharding`)
    tp_rank, tp_size   this parameter's place in its tp group (set by the tp layers; 0 and 1 otherwise)
    sequence_parallel  replicated over tp but each tp rank saw only s/tp tokens: its gradient is partial
                       and is summed over tp after backward (norms under sequence parallelism)
    shared_embedding   a tied word embedding split over pipeline stages: its gradient is summed over the
                       embedding group (both the first stage's table and the last stage's copy)
    embedding_copy     the last stage's copy of the tied embedding: counted in neither the gradient norm
                       nor the parameter count (the first stage counts it)
    experts            expert parallelism: the global experts [start, stop) this rank holds of a weight
                       stacked over experts along dim 0 (full_shape[0] = all experts); init and checkpoints
                       place the local rows there, its gradient is reduced over the expert-dp group and the
                       gradient norm sums it over the ep group (None: not split over experts)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypedDict, Unpack

import torch

ATTRIBUTE = "ptdp"


@dataclass(frozen=True)
class Span:
    """Local indices [start, stop) along the split axis lie at global [start + offset, stop + offset)."""

    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class Sharding:
    """How one global tensor is split over tp ranks, independent of the tp size.

    dim         the dim split over tp (None: replicated on every tp rank)
    parts       blocks stacked along `dim`, each split separately (SwiGLU's fc1 [gate; up]: rank r keeps
                gate_r and up_r, so its local output still chunks in two). QKV needs none: it is laid out per
                query group, so a contiguous split gives each rank whole groups.
    valid_rows  rows of dim 0 that are real (the vocabulary of a table padded to a multiple that grows with
                tp); the padding rows are never stored in checkpoints nor exported (None: every row is)
    """

    dim: int | None = None
    parts: int = 1
    valid_rows: int | None = None

    def __post_init__(self) -> None:
        if self.valid_rows is not None and self.dim not in (None, 0):
            raise ValueError(f"valid_rows count rows (dim 0), but the tensor is split along dim {self.dim}")

    def axis(self, tp_size: int) -> int:
        """The dim whose local indices `spans` maps: the split dim, else rows."""
        return self.dim if self.dim is not None and tp_size > 1 else 0

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank's shard of the full tensor (a view; the full tensor itself when nothing is split)."""
        if self.dim is None or size == 1:
            return full
        if self.dim == 1:  # the input dim of a row-parallel weight
            local = full.shape[1] // size
            return full.narrow(1, rank * local, local)
        rest = full.shape[1:]
        blocks = full.reshape(self.parts, full.shape[0] // self.parts, *rest)
        block_local = blocks.shape[1] // size
        return blocks.narrow(1, rank * block_local, block_local).reshape(-1, *rest)

    def merge(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard in rank order (inverse of `shard`)."""
        if self.dim is None or len(shards) == 1:
            return shards[0]
        if self.dim == 1 or self.parts == 1:
            return torch.cat(shards, dim=self.dim)
        per_rank = [shard.chunk(self.parts, dim=0) for shard in shards]
        return torch.cat([blocks[p] for p in range(self.parts) for blocks in per_rank], dim=0)

    def spans(self, local_len: int, rank: int, size: int) -> list[Span]:
        """Where rank's shard lies in the global tensor along `axis(size)`: one span per stacked part, the
        padding rows left out (they are not stored). `local_len` is the shard's length along that axis."""
        if self.dim is None or size == 1:
            spans = [Span(0, local_len, 0)]
        else:
            part = local_len // self.parts  # [parts blocks of part] locally, each a slice of a global block
            spans = [
                Span(b * part, (b + 1) * part, b * part * size + rank * part - b * part) for b in range(self.parts)
            ]
        if self.valid_rows is None:
            return spans
        clipped = (Span(s.start, min(s.stop, self.valid_rows - s.offset), s.offset) for s in spans)
        return [s for s in clipped if s.start < s.stop]

    def stored_shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape checkpoints and exports hold: the full shape without padding rows."""
        return full_shape if self.valid_rows is None else (self.valid_rows,) + tuple(full_shape[1:])

    def stored(self, full: torch.Tensor) -> torch.Tensor:
        """The full tensor without its padding rows (as exported)."""
        return full if self.valid_rows is None else full[: self.valid_rows].contiguous()

    def padded(self, tensor: torch.Tensor, rows: int) -> torch.Tensor:
        """A table with `rows` rows: the real rows of `tensor`, then zero rows (padding rows never score);
        tensors without padding rows come back unchanged."""
        if self.valid_rows is None:
            return tensor
        tensor = tensor[: self.valid_rows]
        if tensor.shape[0] >= rows:
            return tensor[:rows].contiguous()
        return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])]).contiguous()


REPLICATED = Sharding()


@dataclass(frozen=True)
class ParamInfo:
    """The per-parameter facts shared by model/, parallel/ and training/ (see the module docstring)."""

    init_name: str | None = None
    full_shape: tuple[int, ...] | None = None
    sharding: Sharding = REPLICATED
    tp_rank: int = 0
    tp_size: int = 1
    sequence_parallel: bool = False
    shared_embedding: bool = False
    embedding_copy: bool = False
    experts: tuple[int, int] | None = None

    @property
    def tensor_parallel(self) -> bool:
        """True: each tp rank holds a different shard; False: replicated on every tp rank."""
        return self.sharding.dim is not None and self.tp_size > 1

    def local_shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full tensor: its experts' rows (expert parallelism), then its tp shard."""
        if self.experts is not None:
            full = full.narrow(0, self.experts[0], self.experts[1] - self.experts[0])
        return self.sharding.shard(full, self.tp_rank, self.tp_size)

    def spans(self, local_len: int) -> list[Span]:
        """Where this rank's shard lies in the stored global tensor (see Sharding.spans); an expert-parallel
        weight's rows (not split over tp) lie at its first expert's. `local_len` counts rows along dim 0, or
        of a matrix view [E_local x r, c] of a 3-D weight: each expert's rows are consecutive either way."""
        if self.experts is not None:
            if self.tensor_parallel:
                raise ValueError("expert-parallel weights split over tp are not supported")
            rows_per_expert = local_len // (self.experts[1] - self.experts[0])
            return [Span(0, local_len, self.experts[0] * rows_per_expert)]
        return self.sharding.spans(local_len, self.tp_rank, self.tp_size)


_DEFAULT = ParamInfo()


class ParamInfoFields(TypedDict, total=False):
    """Keyword arguments of `set_param_info`: any of ParamInfo's fields."""

    init_name: str | None
    full_shape: tuple[int, ...] | None
    sharding: Sharding
    tp_rank: int
    tp_size: int
    sequence_parallel: bool
    shared_embedding: bool
    embedding_copy: bool
    experts: tuple[int, int] | None


def param_info(param: torch.Tensor) -> ParamInfo:
    """The parameter's record (the default record when none was set)."""
    return getattr(param, ATTRIBUTE, _DEFAULT)


def set_param_info(param: torch.Tensor, **fields: Unpack[ParamInfoFields]) -> ParamInfo:
    """Replace the given fields of the parameter's record; returns the new record."""
    info = dataclasses.replace(param_info(param), **fields)
    setattr(param, ATTRIBUTE, info)
    return info


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether `param` holds some of the experts of an expert-parallel layer (ParamInfo.experts set)."""
    return param_info(param).experts is not None


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape of `param`."""
    shape = param_info(param).full_shape
    return tuple(param.shape) if shape is None else tuple(shape)
