"""The global view of this rank's tensors: which rectangle of which global tensor each local element is.

A checkpoint stores every tensor under its global name with its global shape (`layers.5.mlp.fc1.weight`,
[ffn, h]), whatever layout wrote it. A rank holds pieces of those tensors: its tp shard (rows or columns; both
halves of SwiGLU's stacked fc1; vocabulary rows up to the real vocabulary size, the tp padding is not stored;
all read off the parameter's model/param_info.Sharding),
and with the distributed optimizer a flat range of it. `GlobalPieces` lists such pieces as (global offsets,
local view) pairs (`pieces_of`), which checkpoint/dcp_planners.py hands to torch.distributed.checkpoint
to write and reshard like DTensor shards.

Tensors are 1-D, 2-D or 3-D here; a 1-D tensor of n elements is handled as an [n, 1] matrix internally, a
3-D one (the MoE experts' stacked weights [E, r, c]) as an [E x r, c] matrix whose pieces are cut at each
expert's boundary and stored at their 3-D offsets, so the checkpoint holds the true [E, r, c] tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from model.param_info import full_shape, param_info


@dataclass(frozen=True)
class Block:
    """Local rows [r0, r1) x cols [c0, c1) of a (2-D viewed) local tensor, at global (row_off, col_off)."""

    r0: int
    r1: int
    c0: int
    c1: int
    row_off: int = 0
    col_off: int = 0

    def intersect(self, r0: int, r1: int, c0: int, c1: int) -> Block | None:
        lo_r, hi_r, lo_c, hi_c = max(self.r0, r0), min(self.r1, r1), max(self.c0, c0), min(self.c1, c1)
        if lo_r >= hi_r or lo_c >= hi_c:
            return None
        return Block(lo_r, hi_r, lo_c, hi_c, self.row_off, self.col_off)


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """[n] -> [n, 1]; [r, c] unchanged; [E, r, c] -> [E x r, c] (a view each time)."""
    if tensor.ndim == 1:
        return tensor.view(-1, 1)
    if tensor.ndim not in (2, 3):
        raise ValueError(f"checkpoint pieces support 1-D, 2-D and 3-D tensors, got shape {tuple(tensor.shape)}")
    return tensor.view(-1, tensor.shape[-1])


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of a tensor of `shape` seen as `as_matrix` sees it."""
    if len(shape) not in (1, 2, 3):
        raise ValueError(f"checkpoint pieces support 1-D, 2-D and 3-D tensors, got shape {shape}")
    return (shape[0], 1) if len(shape) == 1 else (math.prod(shape[:-1]), shape[-1])


def global_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The stored shape: the unsharded one without the vocabulary padding rows (its Sharding's valid rows)."""
    return param_info(param).sharding.stored_shape(full_shape(param))


def tp_blocks(param: torch.Tensor) -> list[Block]:
    """Where this rank's tp shard of `param` lies in the global tensor, as local-to-global blocks: one per
    stacked part (SwiGLU's fc1 [gate; up]), padding rows left out (read off the parameter's Sharding)."""
    rows, cols = matrix_shape(tuple(param.shape))  # shapes only: FSDP's are DTensors
    info = param_info(param)
    if info.sharding.axis(info.tp_size) == 1:  # a row-parallel weight: columns split
        return [Block(0, rows, s.start, s.stop, 0, s.offset) for s in info.spans(cols)]
    return [Block(s.start, s.stop, 0, cols, s.offset) for s in info.spans(rows)]


def flat_range_rects(rows: int, cols: int, start: int, end: int) -> list[tuple[int, int, int, int]]:
    """The flat element range [start, end) of a row-major [rows, cols] matrix as <= 3 rectangles
    (r0, r1, c0, c1): the tail of the first row, whole middle rows, the head of the last row."""
    rects: list[tuple[int, int, int, int]] = []
    if start >= end:
        return rects
    first_row, first_col = divmod(start, cols)
    last_row, last_col = divmod(end, cols)  # exclusive end position
    if first_row == last_row:
        return [(first_row, first_row + 1, first_col, last_col)]
    if first_col:
        rects.append((first_row, first_row + 1, first_col, cols))
        first_row += 1
    if last_row > first_row:
        rects.append((first_row, last_row, 0, cols))
    if last_col:
        rects.append((last_row, last_row + 1, 0, last_col))
    return rects


def pieces_of(
    flat: torch.Tensor,
    flat_start: int,
    shape: tuple[int, ...],
    blocks: list[Block],
) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Pieces of a param-shaped tensor of which `flat` holds the flat elements [flat_start, flat_start +
    flat.numel()) (the whole tensor, or a distributed-optimizer shard), as (global offsets, view of flat)."""
    rows, cols = matrix_shape(shape)
    out: list[tuple[tuple[int, ...], torch.Tensor]] = []
    for rect in flat_range_rects(rows, cols, flat_start, flat_start + flat.numel()):
        for block in blocks:
            part = block.intersect(*rect)
            if part is None:
                continue
            # A part is one partial row or whole rows (blocks span all columns): contiguous in flat.
            begin = part.r0 * cols + part.c0 - flat_start
            n_rows, n_cols = part.r1 - part.r0, part.c1 - part.c0
            view = flat[begin : begin + n_rows * n_cols].view(n_rows, n_cols)
            offsets: tuple[int, ...] = (part.r0 + part.row_off, part.c0 + part.col_off)
            if len(shape) == 1:
                view, offsets = view.reshape(-1), offsets[:1]
            if len(shape) == 3:
                out.extend(_per_expert(offsets, view, shape[1]))
            else:
                out.append((offsets, view))
    return out


def _per_expert(
    offsets: tuple[int, ...], view: torch.Tensor, rows_per_expert: int
) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """A piece of an [E x r, c] matrix at global (row, col) as pieces of the [E, r, c] tensor: cut where one
    expert's rows end (a distributed-optimizer range may span several), each at (expert, row, col)."""
    row, col = offsets
    out: list[tuple[tuple[int, ...], torch.Tensor]] = []
    start = row
    while start < row + view.shape[0]:
        stop = min(row + view.shape[0], (start // rows_per_expert + 1) * rows_per_expert)
        piece = view[start - row : stop - row].unsqueeze(0)  # [1, rows, cols]
        out.append(((start // rows_per_expert, start % rows_per_expert, col), piece))
        start = stop
    return out
