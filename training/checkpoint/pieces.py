"""The global view of this rank's tensors: which rectangle of which global tensor each local element is.

A checkpoint stores every tensor under its global name with its global shape (`layers.5.mlp.fc1.weight`,
[ffn, h]), whatever layout wrote it. A rank holds pieces of those tensors: its tp shard (rows or columns; both
halves of SwiGLU's stacked fc1; vocabulary rows up to the real vocabulary size, the tp padding is not stored),
and with the distributed optimizer a flat range of it. `GlobalPieces` lists such pieces as (global offsets,
local view) pairs (`pieces_of`), which training/checkpoint/dcp_planners.py hands to torch.distributed.checkpoint
to write and reshard like DTensor shards.

Tensors are 1-D or 2-D here; a 1-D tensor of n elements is handled as an [n, 1] matrix internally.
"""

from __future__ import annotations

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
    """[n] -> [n, 1]; [r, c] unchanged (a view either way)."""
    if tensor.ndim == 1:
        return tensor.view(-1, 1)
    if tensor.ndim != 2:
        raise ValueError(f"checkpoint pieces support 1-D and 2-D tensors, got shape {tuple(tensor.shape)}")
    return tensor


VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def global_shape(param: torch.Tensor, name: str, vocab_size: int) -> tuple[int, ...]:
    """The stored shape: the unsharded one, vocabulary rows cut to the real vocabulary (no tp padding)."""
    shape = full_shape(param)
    if name in VOCAB_PARAMS:
        shape = (vocab_size,) + shape[1:]
    return shape


def tp_blocks(param: torch.Tensor, name: str, tp_rank: int, tp_size: int, vocab_size: int) -> list[Block]:
    """Where this rank's tp shard of `param` lies in the global tensor, as local-to-global blocks."""
    local = as_matrix(param)
    rows, cols = local.shape
    info = param_info(param)
    partition_dim = info.partition_dim
    tensor_parallel = info.tensor_parallel and tp_size > 1
    if not tensor_parallel:
        blocks = [Block(0, rows, 0, cols)]
    elif partition_dim == 1:
        blocks = [Block(0, rows, 0, cols, 0, tp_rank * cols)]
    else:
        # SwiGLU's fc1 is [gate; up] and each half is split (parallel/tp_layers.shard_dim0's num_stacked)
        stacked = getattr(info.shard_fn, "keywords", {}).get("num_stacked", 1)
        block_rows = rows // stacked  # [stacked blocks of rows/stacked] locally, each a slice of a global block
        blocks = [
            Block(
                b * block_rows,
                (b + 1) * block_rows,
                0,
                cols,
                b * block_rows * tp_size + tp_rank * block_rows - b * block_rows,
            )
            for b in range(stacked)
        ]
    if name in VOCAB_PARAMS:  # the padding rows (a multiple that grows with tp) are not stored
        blocks = [b for b in (blk.intersect(0, vocab_size - blk.row_off, 0, cols) for blk in blocks) if b]
    return blocks


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
    rows = shape[0]
    cols = shape[1] if len(shape) == 2 else 1
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
            out.append((offsets, view))
    return out
