"""Cutting the GPT into pipeline stages and virtual chunks.

With p pipeline ranks and v chunks per rank, chunk c on rank r is virtual stage c*p + r and holds the layer
block [k * L/(p*v), (k+1) * L/(p*v)) for k = c*p + r, as in Megatron (8 layers, 2 stages, 2 chunks: rank 0 holds
layers 0-1 and 4-5). The embedding goes with virtual stage 0, final norm + output layer + loss with the last.

V-shaped placement (`v_shape`, the ZB-V schedule, v = 2): rank r holds virtual stages r and 2p-1-r, so the
activations run down the ranks and back up; rank p-1 passes its chunk 0 output to its own chunk 1, and rank 0
holds both the first and the last stage (embedding and loss).
"""

from __future__ import annotations


def virtual_stage(pp_rank: int, chunk: int, pp_size: int, v_shape: bool = False) -> int:
    """Virtual stage of chunk `chunk` on pipeline rank `pp_rank`: c*p + r (Megatron's interleaving), or with
    the V-shaped placement r for chunk 0 and 2p-1-r for chunk 1."""
    if v_shape and chunk == 1:
        return 2 * pp_size - 1 - pp_rank
    return chunk * pp_size + pp_rank


def stage_rank(stage: int, pp_size: int, v_shape: bool = False) -> int:
    """The pipeline rank that holds virtual stage `stage` (the inverse of `virtual_stage`)."""
    if v_shape and stage >= pp_size:
        return 2 * pp_size - 1 - stage
    return stage % pp_size


def last_virtual_stage(pp_size: int, vp_size: int) -> int:
    """The virtual stage that holds the output layer and the loss."""
    return pp_size * vp_size - 1


def chunk_layer_ids(
    num_layers: int, pp_size: int, pp_rank: int, vp_size: int, chunk: int, v_shape: bool = False
) -> list[int]:
    """Global layer indices held by model chunk `chunk` of pipeline rank `pp_rank`."""
    per_chunk = num_layers // (pp_size * vp_size)
    start = virtual_stage(pp_rank, chunk, pp_size, v_shape) * per_chunk
    return list(range(start, start + per_chunk))


def chunk_roles(pp_size: int, pp_rank: int, vp_size: int, chunk: int, v_shape: bool = False) -> tuple[bool, bool]:
    """(pre_process, post_process): whether the chunk holds the embedding and whether it holds the head."""
    stage = virtual_stage(pp_rank, chunk, pp_size, v_shape)
    return stage == 0, stage == last_virtual_stage(pp_size, vp_size)
