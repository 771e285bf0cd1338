"""Cutting the GPT into pipeline stages and virtual chunks: the stage map, declared once.

With p pipeline ranks and v chunks per rank, chunk c on rank r is virtual stage c*p + r and holds the layer
block [k * L/(p*v), (k+1) * L/(p*v)) for k = c*p + r, as in Megatron (8 layers, 2 stages, 2 chunks: rank 0 holds
layers 0-1 and 4-5). The embedding goes with virtual stage 0, final norm + output layer + loss with the last.

V-shaped placement (`v_shape`, the ZB-V schedule, v = 2): rank r holds virtual stages r and 2p-1-r, so the
activations run down the ranks and back up; rank p-1 passes its chunk 0 output to its own chunk 1, and rank 0
holds both the first and the last stage (embedding and loss).

`StageMap` answers every placement question (which layers a chunk holds, whether it holds the embedding or
the head, which pipeline ranks hold a copy of the tied embedding); the trainer's model builder, the planner,
the converters and tools/model_stats.py ask it. The free functions below are its arithmetic, also used by
the p2p plan and the simulator, which work on (pp_rank, chunk) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class ChunkPlacement:
    """One model chunk of a pipeline rank: its virtual stage, its layers and whether it holds the ends."""

    chunk: int  # index among the rank's chunks
    virtual_stage: int
    layer_ids: tuple[int, ...]  # global layer indices, ascending
    pre_process: bool  # holds the embedding (virtual stage 0)
    post_process: bool  # holds final norm, output layer and loss (the last virtual stage)


@dataclass(frozen=True)
class StageMap:
    """Where the virtual stages sit: pp ranks, vp chunks each, interleaved or in a V (zb-v)."""

    pp_size: int
    vp_size: int = 1
    v_shape: bool = False

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.vp_size

    @property
    def last_stage(self) -> int:
        """The virtual stage of the output layer and the loss."""
        return last_virtual_stage(self.pp_size, self.vp_size)

    def virtual_stage(self, pp_rank: int, chunk: int) -> int:
        return virtual_stage(pp_rank, chunk, self.pp_size, self.v_shape)

    def stage_rank(self, stage: int) -> int:
        return stage_rank(stage, self.pp_size, self.v_shape)

    def layers_per_chunk(self, num_layers: int) -> int:
        """Layers of every virtual stage (parallel/layout.check_pipeline_split guarantees it divides)."""
        return num_layers // self.num_stages

    def placement(self, num_layers: int, pp_rank: int, chunk: int) -> ChunkPlacement:
        """Chunk `chunk` of pipeline rank `pp_rank` in a model of `num_layers` layers."""
        stage = self.virtual_stage(pp_rank, chunk)
        per_chunk = self.layers_per_chunk(num_layers)
        layers = tuple(range(stage * per_chunk, (stage + 1) * per_chunk))
        return ChunkPlacement(chunk, stage, layers, stage == 0, stage == self.last_stage)

    def placements(self, num_layers: int, pp_rank: int) -> tuple[ChunkPlacement, ...]:
        """Every chunk of pipeline rank `pp_rank`, in chunk order."""
        return tuple(self.placement(num_layers, pp_rank, c) for c in range(self.vp_size))

    @property
    def embedding_pp_rank(self) -> int:
        """The pipeline rank that holds the embedding (virtual stage 0)."""
        return self.stage_rank(0)

    @property
    def head_pp_rank(self) -> int:
        """The pipeline rank that holds the output layer and the loss (the last virtual stage)."""
        return self.stage_rank(self.last_stage)

    @property
    def embedding_pp_ranks(self) -> tuple[int, ...]:
        """Pipeline ranks that hold a copy of a tied word embedding (the embedding's and the head's), ascending:
        two with interleaving, one (rank 0, which then sums the two copies' gradients itself) in a V or with
        pp = 1. The embedding group of parallel/state.py is built from these."""
        return tuple(sorted({self.embedding_pp_rank, self.head_pp_rank}))
