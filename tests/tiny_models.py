"""The tiny models the tests build: one of our ModelConfig and one transformers config per family, so that a
test names only what its model changes of the tiny one (issue 41).

Not a test file (no tier mark): imported by the tests of model/, parallel/ and the converters.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, overload

from model.config import ModelConfig

if TYPE_CHECKING:
    from transformers import GPT2Config, LlamaConfig

# Two layers of width 32 (4 heads of 8), 8 tokens, a 50-token vocabulary (padded to ModelConfig's multiple), no
# dropout: a forward is repeatable, so layouts and kernels compare exactly, and it costs milliseconds on a CPU.
TINY = MappingProxyType(
    dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=8,
        vocab_size=50,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
)

# What each style changes of ModelConfig's defaults (GPT-2's learned positions, LayerNorm, GeLU, tied output
# layer, biases): Llama's rotary positions, RMSNorm, SwiGLU, grouped-query attention, untied, no biases.
STYLES = MappingProxyType(
    {
        "gpt": MappingProxyType({}),
        "llama": MappingProxyType(
            dict(
                position_embedding_type="rope",
                normalization="rmsnorm",
                activation="swiglu",
                num_query_groups=2,
                tie_embeddings=False,
                add_bias_linear=False,
            )
        ),
    }
)

# transformers' configs of the converters' tests: 2 layers of width 64, 64 positions, 300 tokens; bos and eos
# token 0 (inside that vocabulary; transformers' defaults are GPT-2's and Llama's own ids).
TINY_HF = MappingProxyType(
    {
        "gpt2": MappingProxyType(
            dict(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
        ),
        "llama": MappingProxyType(
            dict(
                vocab_size=300,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=8,
                num_key_value_heads=2,
                max_position_embeddings=64,
                tie_word_embeddings=False,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
    }
)


def tiny_config(style: str = "gpt", **overrides: Any) -> ModelConfig:
    """The tiny GPT (TINY) in `style` ("gpt" or "llama", STYLES), with `overrides` of any ModelConfig keys
    applied last (a style's keys too: tie_embeddings=True gives a tied Llama)."""
    if style not in STYLES:
        raise ValueError(f"style={style!r} is not one of {', '.join(STYLES)}")
    return ModelConfig(**{**TINY, **STYLES[style], **overrides})


@overload
def tiny_hf_config(family: Literal["gpt2"], **overrides: Any) -> GPT2Config: ...


@overload
def tiny_hf_config(family: Literal["llama"], **overrides: Any) -> LlamaConfig: ...


def tiny_hf_config(family: str, **overrides: Any) -> GPT2Config | LlamaConfig:
    """transformers' config of the tiny `family` ("gpt2": GPT2Config, "llama": LlamaConfig; TINY_HF), with
    `overrides` of its keys; built offline, nothing downloaded."""
    if family not in TINY_HF:
        raise ValueError(f"family={family!r} is not one of {', '.join(TINY_HF)}")
    # imported here: transformers takes seconds to import and most tests that import this module never need it
    import transformers

    config = {**TINY_HF[family], **overrides}
    return transformers.GPT2Config(**config) if family == "gpt2" else transformers.LlamaConfig(**config)
