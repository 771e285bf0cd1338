"""The model section of the config: the shape and style of one GPT (GPT-2/3 or Llama style)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class ModelConfig:
    """Hyper-parameters of the GPT decoder; `vocab_size` None means "take it from the tokenizer"."""

    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # grouped-query attention; None = one group per head (MHA)
    ffn_hidden_size: int | None = None  # None: 4h for GeLU, Llama's 2/3 * 4h rounded to 64 for SwiGLU
    seq_length: int = 128
    max_position_embeddings: int | None = None  # None = seq_length
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: str = "learned"  # learned | rope
    rotary_base: float = 10000.0
    normalization: str = "layernorm"  # layernorm | rmsnorm
    norm_epsilon: float = 1e-5
    activation: str = "gelu"  # gelu | swiglu
    tie_embeddings: bool = True
    add_bias_linear: bool = True
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_std: float = 0.02
    fused_kernels: bool = False  # model/kernels: Triton on CUDA (or TRITON_INTERPRET=1), else torch paths
    fused_kernel_names: list[str] | None = None  # with fused_kernels: only these (None = all)

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "position_embedding_type": ("learned", "rope"),
        "normalization": ("layernorm", "rmsnorm"),
        "activation": ("gelu", "swiglu"),
    }

    def validate(self) -> None:
        """Checks local to this section; each error names the key and its value."""
        for key, choices in self.CHOICES.items():
            if getattr(self, key) not in choices:
                raise ValueError(f"model.{key}={getattr(self, key)!r} is not one of {', '.join(choices)}")
        for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "make_vocab_size_divisible_by"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1")
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
