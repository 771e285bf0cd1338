"""Activation memory of one transformer layer for one micro-batch (the paper §3.5, Korthikanti et al. 2022).

Korthikanti et al. count, per layer, s*b*h*(34 + 5*a*s/h) bytes with 16-bit values and 1-byte dropout masks:
16 s*b*h values (norm inputs 2, qkv input 1, q/k/v 3, attention output 1, fc1 input 1, GeLU input 4, fc2
input 4), two s*b*h dropout masks, and for the materialised attention the softmax output and the dropout
output (a*s^2*b values each) plus its mask (a*s^2*b). Tensor parallelism splits all but the norm inputs,
the qkv and fc1 inputs and the two masks (10 s*b*h of the 34); sequence parallelism splits those too.
Selective recomputation drops the a*s^2*b terms, full recomputation keeps only the layer input.

Generalised here to the value size of the run (2 bytes for bf16/fp16 activations, 4 for fp32), grouped-query
attention, any ffn width, SwiGLU (fc1 output of 2 ffn values), dropout off (no masks), and fused attention
kernels that keep no [s, s] tensor (`attention="flash"`: only a fp32 log-sum-exp per query row).

Context parallelism (cp) gives each rank s / cp tokens of every sequence: every term counts the local sequence
(`ActivationShape.local_seq`, RunShape's local_seq_length), and ring attention keeps, like a flash kernel, only a
log-sum-exp per query row besides q, k, v and the output (parallel/context_parallel.py), so its attention is
"flash" whatever the backend of one process would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from parallel.run_shape import RunShape
from planner.fusion import FUSIONS, fused_operators

if TYPE_CHECKING:
    from config.schema import Config
    from parallel.layout import Layout


@dataclass(frozen=True)
class ActivationShape:
    """What the formula needs: sizes, tp, and what the kernels keep. `shape_from_config` builds it from a
    RunShape; a test may write one by hand to pin the formula at the paper's sizes."""

    seq_length: int  # keys each query attends to: the whole sequence, whatever cp is
    local_seq: int  # tokens of each sequence on one rank (RunShape.local_seq_length: seq_length / cp)
    micro_batch: int
    hidden: int
    heads: int
    query_groups: int
    ffn: int
    swiglu: bool
    tp_size: int
    sequence_parallel: bool  # splits something: asked for and tp > 1 (RunShape.sequence_parallel)
    value_bytes: int  # 2 for bf16/fp16 activations, 4 for fp32
    mask_bytes: int = 1  # a dropout mask element (bool on GPU)
    hidden_dropout: bool = True
    attention_dropout: bool = True
    attention: str = "materialized"  # or "flash"
    cp_size: int = 1  # context parallelism: the ranks each sequence is cut over
    # the memory-bound chains that run fused (planner/fusion.py; the time model only, the kept bytes are the
    # fused kernels'): all by default, as the cost formulas are written; the config's kernel selection decides
    fused: frozenset[str] = FUSIONS

    @property
    def attention_kept(self) -> str:
        """What the attention keeps for backward: ring attention (cp > 1) keeps what a flash kernel keeps."""
        return "flash" if self.cp_size > 1 else self.attention


def shape_from_config(config: Config, layout: Layout, attention: str = "materialized") -> ActivationShape:
    """The ActivationShape of a run config (a config.schema.Config) under its `layout`: every size that follows
    from the layout (local sequence, tp, cp, sequence parallelism, value size) is RunShape's."""
    run = RunShape.of(config, layout)
    model = run.model
    return ActivationShape(
        seq_length=model.seq_length,
        local_seq=run.local_seq_length,
        micro_batch=run.train.micro_batch_size,
        hidden=model.hidden_size,
        heads=model.num_attention_heads,
        query_groups=model.query_groups,
        ffn=model.ffn_size,
        swiglu=model.activation == "swiglu",
        tp_size=layout.tp_size,
        sequence_parallel=run.sequence_parallel,
        value_bytes=run.value_bytes,
        hidden_dropout=model.hidden_dropout > 0,
        attention_dropout=model.attention_dropout > 0,
        attention=attention,
        cp_size=layout.cp_size,
        fused=fused_operators(model, attention),
    )


def attention_score_bytes(shape: ActivationShape) -> float:
    """Bytes of the [b, a/t, s, s] tensors a materialised attention keeps for backward (0 when fused)."""
    sb = shape.local_seq * shape.micro_batch
    if shape.attention_kept != "materialized":
        return 4.0 * sb * shape.heads / shape.tp_size  # fp32 log-sum-exp per query row
    scores = shape.heads * shape.seq_length * sb / shape.tp_size
    if shape.attention_dropout:  # softmax output, dropout output, dropout mask
        return scores * (2 * shape.value_bytes + shape.mask_bytes)
    return scores * shape.value_bytes  # softmax output only


def layer_activation_bytes(shape: ActivationShape, recompute: str) -> float:
    """Bytes one layer keeps for its backward, per micro-batch, on one tp rank."""
    sbh = shape.local_seq * shape.micro_batch * shape.hidden
    t = shape.tp_size
    replicated_split = t if shape.sequence_parallel else 1
    if recompute == "full":
        return shape.value_bytes * sbh / replicated_split  # only the layer input
    kv_share = shape.query_groups / shape.heads
    # norm inputs (2), qkv input, fc1 input: replicated across tp unless sequence parallel
    replicated = 4 * sbh * shape.value_bytes
    masks = 2 * sbh * shape.mask_bytes if shape.hidden_dropout else 0
    ffn_values = shape.local_seq * shape.micro_batch * shape.ffn * (3 if shape.swiglu else 2)
    split = (sbh * (2 + 2 * kv_share) + ffn_values) * shape.value_bytes  # q, k, v, attention out, MLP
    total = (replicated + masks) / replicated_split + split / t
    if recompute != "selective":
        total += attention_score_bytes(shape)
    return total


def head_activation_bytes(shape: ActivationShape, padded_vocab: int) -> float:
    """Bytes the last virtual stage keeps per micro-batch beyond its layers: the final norm input and
    output-layer input (16/32-bit) and the fp32 logits of the vocab-parallel cross entropy."""
    sb = shape.local_seq * shape.micro_batch
    split = shape.tp_size if shape.sequence_parallel else 1
    return 2.0 * sb * shape.hidden * shape.value_bytes / split + 4.0 * sb * padded_vocab / shape.tp_size


def embedding_activation_bytes(shape: ActivationShape) -> float:
    """Virtual stage 0: the embedding dropout mask (nothing else is kept for the embedding's backward)."""
    if not shape.hidden_dropout:
        return 0.0
    split = shape.tp_size if shape.sequence_parallel else 1
    return shape.local_seq * shape.micro_batch * shape.hidden * shape.mask_bytes / split
