"""The global view of local shards: any save layout's pieces reassemble the full tensor and any load layout
gets exactly its shard back through torch.distributed.checkpoint (one process, layouts emulated)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from checkpoint.dcp_planners import GlobalPieces, PiecesLoadPlanner
from checkpoint.loader import read_global_tensors
from checkpoint.pieces import Block, flat_range_rects, pieces_of, tp_blocks
from checkpoint.saver import SaveJob, write_checkpoint
from model.param_info import Sharding, set_param_info

pytestmark = pytest.mark.tier("fast")


def test_flat_range_rects_cover_the_range_exactly():
    rng = random.Random(0)
    for _ in range(300):
        rows, cols = rng.randint(1, 7), rng.randint(1, 7)
        start = rng.randint(0, rows * cols)
        end = rng.randint(start, rows * cols)
        covered = sorted(
            r * cols + c
            for r0, r1, c0, c1 in flat_range_rects(rows, cols, start, end)
            for r in range(r0, r1)
            for c in range(c0, c1)
        )
        assert covered == list(range(start, end)), (rows, cols, start, end)


def _param(full: torch.Tensor, tp_rank: int, tp_size: int, sharding: Sharding) -> nn.Parameter:
    """A tp shard carrying the ParamInfo the tp layers set."""
    param = nn.Parameter(sharding.shard(full, tp_rank, tp_size).clone())
    set_param_info(param, sharding=sharding, tp_rank=tp_rank, tp_size=tp_size, full_shape=tuple(full.shape))
    return param


VOCAB = 13
CASES = [
    ("layers.0.mlp.fc1.weight", (16, 3), Sharding(dim=0, parts=2)),  # SwiGLU's stacked [gate; up]
    ("layers.0.attention.proj.weight", (4, 8), Sharding(dim=1)),
    ("layers.0.attention.qkv.bias", (12,), Sharding(dim=0)),
    ("layers.0.input_norm.weight", (6,), Sharding()),
    ("embedding.word_embeddings.weight", (16, 3), Sharding(dim=0, valid_rows=VOCAB)),  # 16 padded rows
]


@pytest.mark.parametrize("name,shape,sharding", CASES)
@pytest.mark.parametrize("save_tp,save_dp,load_tp,load_dp", [(2, 2, 4, 1), (4, 3, 1, 2), (1, 1, 2, 3)])
def test_pieces_reshard_between_tp_and_flat_dp_shards(
    tmp_path, name, shape, sharding, save_tp, save_dp, load_tp, load_dp
):
    full = torch.randn(shape)
    stored = full[:VOCAB] if name.startswith("embedding") else full
    pieces = []
    for tp_rank in range(save_tp):  # every tp rank writes, each dp rank its flat shard of the tp shard
        param = _param(full, tp_rank, save_tp, sharding)
        blocks = tp_blocks(param)
        if sharding.dim is None and tp_rank > 0:
            continue  # replicated: tp rank 0 writes
        flat = param.detach().view(-1)
        bounds = [flat.numel() * d // save_dp for d in range(save_dp + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            pieces += pieces_of(flat[lo:hi].clone(), lo, tuple(param.shape), blocks)
    write_checkpoint(SaveJob(str(tmp_path), 1, {name: GlobalPieces(tuple(stored.shape), pieces)}, None, keep_last=0))
    iter_dir = str(tmp_path / "iter_0000001")
    assert torch.equal(read_global_tensors(iter_dir)[name], stored)

    import torch.distributed.checkpoint as dcp

    for tp_rank in range(load_tp):
        expected = _param(full, tp_rank, load_tp, sharding).detach()
        target = torch.zeros_like(expected)
        blocks = tp_blocks(_param(full, tp_rank, load_tp, sharding))
        flat = target.view(-1)
        bounds = [flat.numel() * d // load_dp for d in range(load_dp + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            wanted = {name: GlobalPieces(tuple(stored.shape), pieces_of(flat[lo:hi], lo, tuple(target.shape), blocks))}
            dcp.load(wanted, storage_reader=dcp.FileSystemReader(iter_dir), planner=PiecesLoadPlanner(), no_dist=True)
        if name.startswith("embedding"):  # padding rows are not stored: compare the real vocabulary rows
            keep = max(0, min(target.shape[0], VOCAB - tp_rank * target.shape[0]))
            expected, target = expected[:keep], target[:keep]
        assert torch.equal(target, expected), (tp_rank, name)


def test_block_intersection():
    assert Block(0, 4, 0, 3, 8, 0).intersect(2, 9, 1, 2) == Block(2, 4, 1, 2, 8, 0)
    assert Block(0, 4, 0, 3).intersect(4, 5, 0, 3) is None


def test_two_copies_of_a_tensor_on_one_rank_are_both_loaded(tmp_path):
    """zb-v's rank 0 holds the tied embedding and the head's copy of it: two pieces at the same offsets of one
    key. Each is filled (DCP's ReadItem names the piece by its index), not only the first."""
    import torch.distributed.checkpoint as dcp

    stored = torch.randn(6, 4)
    write_checkpoint(SaveJob(str(tmp_path), 1, {"w": GlobalPieces((6, 4), [((0, 0), stored)])}, None, keep_last=0))
    embedding, head_copy = torch.zeros(6, 4), torch.zeros(6, 4)
    wanted = {"w": GlobalPieces((6, 4), [((0, 0), embedding), ((0, 0), head_copy)])}
    reader = dcp.FileSystemReader(str(tmp_path / "iter_0000001"))
    dcp.load(wanted, storage_reader=reader, planner=PiecesLoadPlanner(), no_dist=True)
    assert torch.equal(embedding, stored) and torch.equal(head_copy, stored)
    with pytest.raises(ValueError, match="2 pieces of w at offsets"):  # without the index: refused, not half-filled
        wanted["w"].piece_at("w", torch.Size((0, 0)))
