"""What a run is, derived once from its model config and its layout: `RunShape`.

Every quantity that follows from (model config, `Layout`, train section) lives here, and the trainer, the
planner, tools/ and convert/ ask for it instead of deriving it again:

    padded_vocab, vocab_local     the vocabulary padded for tp (ModelConfig.padded_vocab_size) and its shard
    local_seq_length              tokens of each sequence on one rank (seq_length / cp)
    sequence_parallel             whether sequence parallelism splits anything (asked for, and tp > 1)
    value_bytes                   bytes of one activation value in the run's precision (train.precision)
    activation_shape              [s/cp(/tp with sequence parallelism), b, h]: what pipeline stages exchange
    flops                         FLOPs of one iteration (model/shape.py's GEMM arithmetic at the padded
                                  vocabulary and the pp x vp chunks that block recomputation counts)
    chunks(pp_rank)               the rank's model chunks: virtual stage, layers, embedding / head (the stage map,
                                  parallel/pipeline/stages.py, V placement included)
    roles(pp_rank)                what the rank holds: the embedding, the head, copies of the tied embedding and
                                  how their gradients meet (summed on the rank under zb-v, all-reduced over the
                                  embedding group otherwise)
    recomputed_layers(chunk)      the layers whose forward full recomputation repeats in backward

Why its own object rather than methods of Layout: a Layout is the model-free answer of the layout rules (it is
printed at start-up, stored in checkpoints and built by the planner for candidates); these quantities also need
the model (layers, vocabulary, sequence) and the train section (batch, recomputation, precision). The planner's
per-layer activation model (planner/activations.ActivationShape) is built from these values, not beside them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from model.config import ModelConfig
from model.precision import precision_dtype
from model.rank_spec import Recompute
from model.shape import IterationFlops, iteration_flops
from parallel.layout import Layout
from parallel.pipeline.stages import ChunkPlacement, StageMap

if TYPE_CHECKING:
    from config.schema import Config, TrainConfig

TIED_NONE, TIED_LOCAL, TIED_GROUP = "none", "local", "group"


@dataclass(frozen=True)
class StageRoles:
    """What one pipeline rank holds at the ends of the model.

    `tied_tables`: separate tensors of a tied word embedding on the rank (0 untied or between the ends;
    1 on the embedding's or the head's rank, also with pp = 1 where the output layer *is* the embedding;
    2 where one rank holds both ends in different chunks, zb-v's rank 0). `tied_reduction` says how the
    copies' gradients meet: TIED_LOCAL (summed on this rank), TIED_GROUP (all-reduced over the embedding
    group) or TIED_NONE.
    """

    pp_rank: int
    holds_embedding: bool
    holds_head: bool
    tied_tables: int
    tied_reduction: str

    @property
    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0


@dataclass(frozen=True)
class RunShape:
    """The derived quantities of one run (module docstring); frozen, no process group needed."""

    model: ModelConfig
    layout: Layout
    train: TrainConfig

    @classmethod
    def of(cls, config: Config, layout: Layout) -> RunShape:
        """From a config.schema.Config and its Layout."""
        return cls(config.model, layout, config.train)

    # ---- sizes ---------------------------------------------------------------------------------------
    @property
    def stages(self) -> StageMap:
        return self.layout.stages

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and the output layer over all tp ranks."""
        return self.model.padded_vocab_size(self.layout.tp_size)

    @property
    def vocab_local(self) -> int:
        """Vocabulary rows on one tp rank."""
        return self.padded_vocab // self.layout.tp_size

    @property
    def local_seq_length(self) -> int:
        """Tokens of each sequence on one rank: seq_length / cp (context parallelism cuts the sequence)."""
        return self.model.seq_length // self.layout.cp_size

    @property
    def sequence_parallel(self) -> bool:
        """Whether sequence parallelism splits the layer's replicated activations: the layout asks for it and
        there are tp ranks to split over (with tp = 1 the flag changes nothing)."""
        return self.layout.sequence_parallel and self.layout.tp_size > 1

    @property
    def value_bytes(self) -> int:
        """Bytes of one activation value in train.precision: 4 for fp32, 2 for bf16 and fp16."""
        return precision_dtype(self.train.precision).itemsize

    @property
    def activation_shape(self) -> tuple[int, int, int]:
        """[s, b, h] of the tensors pipeline stages exchange: s/cp tokens, /tp again with sequence parallelism."""
        seq = self.local_seq_length // (self.layout.tp_size if self.sequence_parallel else 1)
        return seq, self.train.micro_batch_size, self.model.hidden_size

    @property
    def tokens_per_iteration(self) -> int:
        return self.train.global_batch_size * self.model.seq_length

    @property
    def flops(self) -> IterationFlops:
        """FLOPs of one iteration of the global batch (model/shape.iteration_flops)."""
        return iteration_flops(
            self.model, self.padded_vocab, self.train.global_batch_size, self.recompute, self.stages.num_stages
        )

    @property
    def recompute(self) -> Recompute:
        """The train section's recomputation as the model's rule (model.rank_spec.Recompute), without the
        checkpoint function that only the trainer's model build supplies."""
        train = self.train
        return Recompute(train.recompute, train.recompute_method, train.recompute_num_layers)

    # ---- placement -----------------------------------------------------------------------------------
    def chunks(self, pp_rank: int) -> tuple[ChunkPlacement, ...]:
        """The model chunks of pipeline rank `pp_rank`, in chunk order."""
        return self.stages.placements(self.model.num_layers, pp_rank)

    def roles(self, pp_rank: int) -> StageRoles:
        """What pipeline rank `pp_rank` holds at the ends of the model (StageRoles)."""
        chunks = self.chunks(pp_rank)
        holds_embedding = any(c.pre_process for c in chunks)
        holds_head = any(c.post_process for c in chunks)
        ends = [c for c in chunks if c.pre_process or c.post_process]
        tables = len(ends) if self.model.tie_embeddings else 0
        if tables == 2:
            reduction = TIED_LOCAL
        elif tables == 1 and len(self.stages.embedding_pp_ranks) > 1:
            reduction = TIED_GROUP
        else:
            reduction = TIED_NONE
        return StageRoles(pp_rank, holds_embedding, holds_head, tables, reduction)

    def chunk_roles(self, pp_rank: int) -> list[tuple[bool, bool]]:
        """(holds the embedding, holds the head) of each chunk of `pp_rank` (model/shape.rank_params' input)."""
        return [(c.pre_process, c.post_process) for c in self.chunks(pp_rank)]

    def recomputed_layers(self, chunk: ChunkPlacement) -> tuple[int, ...]:
        """Layers of `chunk` whose forward full recomputation repeats in backward: those GPTModel checkpoints
        (model.rank_spec.Recompute: every layer with `uniform`, the first recompute_num_layers with `block`)."""
        return self.recompute.layer_ids(chunk.layer_ids)
