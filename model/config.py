"""The model section of the config: the shape and style of one GPT (GPT-2/3 or Llama style)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import ClassVar


def _structural(compared_as: str | None = None) -> dict[str, str | None]:
    """Field metadata of a key that changes the tensors (names or shapes): a checkpoint must match it.
    `compared_as` names the derived property to compare when the key has a default resolved from others
    (num_query_groups None and num_query_groups == heads build the same tensors)."""
    return {"checkpoint": "structural", "compared_as": compared_as}


_STRUCTURAL = MappingProxyType(_structural())
# Keys that change what a resumed run computes from the same tensors (a fine-tune may change them).
_RESUME_ONLY = MappingProxyType({"checkpoint": "resume_only", "compared_as": None})


def checkpoint_keys(kind: str) -> tuple[str, ...]:
    """The model keys of `kind` ("structural" or "resume_only") as compared against a checkpoint: the field
    name, or the derived property it resolves to (query_groups, ffn_size, max_positions)."""
    return tuple(
        f.metadata.get("compared_as") or f.name for f in fields(ModelConfig) if f.metadata.get("checkpoint") == kind
    )


@dataclass
class ModelConfig:
    """Hyper-parameters of the GPT decoder; `vocab_size` None means "take it from the tokenizer"."""

    num_layers: int = field(default=4, metadata=_STRUCTURAL)
    hidden_size: int = field(default=128, metadata=_STRUCTURAL)
    num_attention_heads: int = field(default=4, metadata=_STRUCTURAL)
    # grouped-query attention; None = one group per head (MHA)
    num_query_groups: int | None = field(default=None, metadata=_structural("query_groups"))
    # None: 4h for GeLU, Llama's 2/3 * 4h rounded to 64 for SwiGLU
    ffn_hidden_size: int | None = field(default=None, metadata=_structural("ffn_size"))
    seq_length: int = field(default=128, metadata=_RESUME_ONLY)
    max_position_embeddings: int | None = field(default=None, metadata=_structural("max_positions"))  # None = s
    vocab_size: int | None = field(default=None, metadata=_STRUCTURAL)
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: str = field(default="learned", metadata=_STRUCTURAL)  # learned | rope
    rotary_base: float = field(default=10000.0, metadata=_RESUME_ONLY)
    normalization: str = field(default="layernorm", metadata=_STRUCTURAL)  # layernorm | rmsnorm
    norm_epsilon: float = 1e-5
    activation: str = field(default="gelu", metadata=_STRUCTURAL)  # gelu | gelu_tanh (GPT-2's gelu_new) | swiglu
    tie_embeddings: bool = field(default=True, metadata=_STRUCTURAL)
    add_bias_linear: bool = field(default=True, metadata=_STRUCTURAL)
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_std: float = 0.02
    fused_kernels: bool = False  # model/kernels: Triton on CUDA (or TRITON_INTERPRET=1), else torch paths
    fused_kernel_names: list[str] | None = None  # with fused_kernels: only these (None = all)

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "position_embedding_type": ("learned", "rope"),
        "normalization": ("layernorm", "rmsnorm"),
        "activation": ("gelu", "gelu_tanh", "swiglu"),
    }

    def validate(self) -> None:
        """Checks local to this section; each error names the key and its value."""
        for key, choices in self.CHOICES.items():
            if getattr(self, key) not in choices:
                raise ValueError(f"model.{key}={getattr(self, key)!r} is not one of {', '.join(choices)}")
        for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "make_vocab_size_divisible_by"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1")
        for key in ("num_query_groups", "ffn_hidden_size", "max_position_embeddings", "vocab_size"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1 (or leave it out for the default)")
        for key in ("norm_epsilon", "init_std"):
            if getattr(self, key) < 0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 0")
        if self.rotary_base <= 0:
            raise ValueError(f"model.rotary_base={self.rotary_base} must be > 0")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.query_groups:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"model.num_query_groups={self.query_groups}"
            )
        for key in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be in [0, 1)")
        if self.max_positions < self.seq_length:
            raise ValueError(
                f"model.max_position_embeddings={self.max_position_embeddings} is smaller than "
                f"model.seq_length={self.seq_length}"
            )
        self._validate_kernels()
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dimension, got {self.head_dim}")

    def _validate_kernels(self) -> None:
        from model.kernels import KERNEL_NAMES

        if self.fused_kernel_names is None:
            return
        if not self.fused_kernels:
            raise ValueError(f"model.fused_kernel_names={self.fused_kernel_names} needs model.fused_kernels=true")
        for name in self.fused_kernel_names:
            if name not in KERNEL_NAMES:
                raise ValueError(f"model.fused_kernel_names: {name!r} is not one of {', '.join(KERNEL_NAMES)}")

    # ---- derived sizes ----------------------------------------------------------------------
    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            return 64 * math.ceil(int(8 * self.hidden_size / 3) / 64)
        return 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Vocabulary padded to a multiple of make_vocab_size_divisible_by * tp (Megatron's rule)."""
        if self.vocab_size is None:
            raise ValueError("model.vocab_size is unknown: set it or let the tokenizer fill it in")
        multiple = self.make_vocab_size_divisible_by * tp_size
        return multiple * math.ceil(self.vocab_size / multiple)
