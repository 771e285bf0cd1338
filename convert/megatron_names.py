"""Megatron-LM's tensor names and ours, one table for both directions: convert/megatron.py (and
megatron_dist.py) read every spelling a Megatron-LM checkpoint may use, convert/megatron_export.py writes
megatron-core's (local layer spec).

Layer tensors are `<prefix>.layers.N.<module>.<weight|bias>`: `LAYER_NAMES` maps the module part (our
`layers.N.<module>`); `GLOBAL_NAMES` maps whole names. Spellings read besides megatron-core's: the legacy
Megatron-LM model (`self_attention.query_key_value`, `mlp.dense_h_to_4h`, `encoder.final_layernorm`) and
Transformer Engine's norms fused into the following linear (`mlp.linear_fc1.layer_norm`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NameRow:
    """Our name, megatron-core's (what export writes), and the other spellings a checkpoint may use."""

    ours: str
    mcore: str
    aliases: tuple[str, ...] = ()
    extra_state: bool = False  # a linear of the local spec: megatron-core stores `<mcore>._extra_state`

    @property
    def spellings(self) -> tuple[str, ...]:
        return (self.mcore, *self.aliases)


LAYER_NAMES: tuple[NameRow, ...] = (
    NameRow("input_norm", "input_layernorm", ("input_norm", "self_attention.linear_qkv.layer_norm")),
    NameRow(
        "attention.qkv",
        "self_attention.linear_qkv",
        ("self_attention.query_key_value", "attention.query_key_value"),
        extra_state=True,
    ),
    NameRow("attention.proj", "self_attention.linear_proj", ("self_attention.dense", "attention.dense"), True),
    NameRow(
        "post_attention_norm",
        "pre_mlp_layernorm",
        ("post_attention_layernorm", "post_attention_norm", "mlp.linear_fc1.layer_norm"),
    ),
    NameRow("mlp.fc1", "mlp.linear_fc1", ("mlp.dense_h_to_4h",), extra_state=True),
    NameRow("mlp.fc2", "mlp.linear_fc2", ("mlp.dense_4h_to_h",), extra_state=True),
)
GLOBAL_NAMES: tuple[NameRow, ...] = (
    NameRow("embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
    NameRow("embedding.position_embeddings.weight", "embedding.position_embeddings.weight"),
    NameRow(
        "final_norm.weight",
        "decoder.final_layernorm.weight",
        ("encoder.final_layernorm.weight", "encoder.final_norm.weight"),
    ),
    NameRow(
        "final_norm.bias", "decoder.final_layernorm.bias", ("encoder.final_layernorm.bias", "encoder.final_norm.bias")
    ),
    NameRow("output_layer.weight", "output_layer.weight"),
)
OUTPUT_EXTRA_STATE = "output_layer._extra_state"  # the output layer's, also where the tied embedding stands in


def to_ours(rows: tuple[NameRow, ...]) -> dict[str, str]:
    """Every spelling -> our name (reading)."""
    return {spelling: row.ours for row in rows for spelling in row.spellings}


def to_mcore(rows: tuple[NameRow, ...]) -> dict[str, str]:
    """Our name -> megatron-core's (writing)."""
    return {row.ours: row.mcore for row in rows}


LAYER_TO_OURS, GLOBAL_TO_OURS = to_ours(LAYER_NAMES), to_ours(GLOBAL_NAMES)
LAYER_TO_MCORE, GLOBAL_TO_MCORE = to_mcore(LAYER_NAMES), to_mcore(GLOBAL_NAMES)
LAYER_EXTRA_STATES = tuple(row.mcore for row in LAYER_NAMES if row.extra_state)
