"""Cutting the GPT into pipeline stages and virtual chunks.

With p pipeline ranks and v chunks per rank, chunk c on rank r is virtual stage c*p + r and holds the layer
block [k * L/(p*v), (k+1) * L/(p*v)) for k = c*p + r, as in Megatron (8 layers, 2 stages, 2 chunks: rank 0 holds
layers 0-1 and 4-5). The embedding goes with virtual stage 0, final norm + output layer + loss with the last.
"""

from __future__ import annotations


def virtual_stage(pp_rank: int, chunk: int, pp_size: int) -> int:
    """Virtual stage of chunk `chunk` on pipeline rank `pp_rank`: c*p + r (Megatron's interleaving)."""
    return chunk * pp_size + pp_rank


def last_virtual_stage(pp_size: int, vp_size: int) -> int:
    """The virtual stage that holds the output layer and the loss."""
    return pp_size * vp_size - 1


def chunk_layer_ids(num_layers: int, pp_size: int, pp_rank: int, vp_size: int, chunk: int) -> list[int]:
    """Global layer indices held by model chunk `chunk` of pipeline rank `pp_rank`."""
    per_chunk = num_layers // (pp_size * vp_size)
    start = virtual_stage(pp_rank, chunk, pp_size) * per_chunk
    return list(range(start, start + per_chunk))


def chunk_roles(pp_size: int, pp_rank: int, vp_size: int, chunk: int) -> tuple[bool, bool]:
    """(pre_process, post_process): whether the chunk holds the embedding and whether it holds the head."""
    stage = virtual_stage(pp_rank, chunk, pp_size)
    return stage == 0, stage == last_virtual_stage(pp_size, vp_size)
