"""The model section of the config: the shape and style of one GPT (GPT-2/3 or Llama style).

It also holds `key_spec`, how every config section declares a key in its field's metadata (its description and
the checks of its value alone), and `check_declared`, the one checker of those declarations. They live here
because model/ imports nothing of config/, and a ModelConfig is validated on its own (convert/ builds one from
Megatron's or transformers' files).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from model.kernels import KernelSelection

# Metadata names of the bounds key_spec() takes, with the comparison each one requires of a value.
_BOUNDS = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}


def key_spec(
    doc: str,
    *,
    choices: tuple[str, ...] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    note: str | None = None,
    also: Mapping[str, object] | None = None,
) -> Mapping[str, object]:
    """The field metadata of a config key: `doc` (what the trainer does with the value: docs/configuration.md's
    text) and the checks of its value alone that `check_declared` runs: one of `choices`, or within the bounds
    ge / gt (lower) and le / lt (upper). A None value passes them (the key's derived default). `note` is
    appended to a refusal; `also` adds other entries (the model's checkpoint kinds)."""
    if (ge is not None and gt is not None) or (le is not None and lt is not None):
        raise TypeError("key_spec(): give one lower bound (ge or gt) and one upper bound (le or lt) at most")
    declared = {"doc": doc, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt, "note": note}
    return MappingProxyType({**(also or {}), **declared})


def declared_refusal(declaration: Field, value: object) -> str | None:
    """Why `value` breaks the checks key_spec() declared on the field, as the end of a one-line error
    ("'fp8' is not one of fp32, bf16, fp16", "0 must be >= 1"), or None when it keeps them."""
    meta = declaration.metadata
    if value is None:
        return None
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        return f"{value!r} is not one of {', '.join(choices)}"
    bounds = {name: meta[name] for name in _BOUNDS if meta.get(name) is not None}
    if not bounds:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value!r} is not a number"
    number: float = value
    if all(_BOUNDS[name](number, bound) for name, bound in bounds.items()):  # NaN fails every comparison
        return None
    if len(bounds) == 2:  # key_spec() allows one lower and one upper bound: an interval
        (lower, low), (upper, high) = sorted(bounds.items(), key=lambda item: item[0] not in ("ge", "gt"))
        opening, closing = "[" if lower == "ge" else "(", "]" if upper == "le" else ")"
        text = f"{value} must be in {opening}{low}, {high}{closing}"
    else:
        ((bound_name, bound),) = bounds.items()
        text = f"{value} must be {dict(ge='>=', gt='>', le='<=', lt='<')[bound_name]} {bound}"
    if meta.get("note"):
        text += f" ({meta['note']})"
    if declaration.default is None:
        text += " (or leave it out for the default)"
    return text


def check_declared(section: DataclassInstance, name: str) -> None:
    """Run the checks key_spec() declared on every field of one section's dataclass; the first value that breaks
    them raises a ValueError of one line naming `name.key` and the value."""
    for declaration in fields(section):
        refusal = declared_refusal(declaration, getattr(section, declaration.name))
        if refusal:
            raise ValueError(f"{name}.{declaration.name}={refusal}")


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


def _kernels() -> ModuleType:
    """model.kernels, imported when a kernel choice is read: it imports torch (~1.7 CPU s), and this module stays
    torch-free for the config readers and the planner."""
    import model.kernels

    return model.kernels


@dataclass
class ModelConfig:
    """The GPT itself (model/config.py): its shape, GPT-2 or Llama style, dropout, init and fused kernels.

    Hyper-parameters of the GPT decoder; `vocab_size` None means "take it from the tokenizer"."""

    num_layers: int = field(
        default=4,
        metadata=key_spec(
            "Transformer layers; must divide by parallel.pp_size x parallel.vp_size.", ge=1, also=_STRUCTURAL
        ),
    )
    hidden_size: int = field(
        default=128,
        metadata=key_spec(
            "Width h of the residual stream; must divide by model.num_attention_heads.", ge=1, also=_STRUCTURAL
        ),
    )
    num_attention_heads: int = field(
        default=4, metadata=key_spec("Attention heads; must divide by parallel.tp_size.", ge=1, also=_STRUCTURAL)
    )
    num_query_groups: int | None = field(
        default=None,
        metadata=key_spec(
            "Grouped-query attention: key/value heads shared by groups of query heads. null: one group per head "
            "(multi-head attention).",
            ge=1,
            also=_structural("query_groups"),
        ),
    )
    ffn_hidden_size: int | None = field(
        default=None,
        metadata=key_spec(
            "Width of the MLP. null: 4h for gelu, Llama's 2/3 x 4h rounded up to a multiple of 64 for swiglu.",
            ge=1,
            also=_structural("ffn_size"),
        ),
    )
    seq_length: int = field(default=128, metadata=key_spec("Tokens per training sample.", ge=1, also=_RESUME_ONLY))
    max_position_embeddings: int | None = field(
        default=None,
        metadata=key_spec(
            "Positions the model has (learned embeddings' rows, the rotary table). null: model.seq_length.",
            ge=1,
            also=_structural("max_positions"),
        ),
    )
    vocab_size: int | None = field(
        default=None,
        metadata=key_spec(
            "Rows of the embedding before padding. null: the tokenizer's vocabulary size (a larger value is "
            "allowed; a smaller one is refused).",
            ge=1,
            also=_STRUCTURAL,
        ),
    )
    make_vocab_size_divisible_by: int = field(
        default=128,
        metadata=key_spec(
            "The embedding is padded to a multiple of this times parallel.tp_size (Megatron's rule); the padded "
            "rows are dropped on export.",
            ge=1,
        ),
    )
    position_embedding_type: str = field(
        default="learned",
        metadata=key_spec(
            "learned (GPT-2: an embedding table) or rope (Llama: rotary embeddings).",
            choices=("learned", "rope"),
            also=_STRUCTURAL,
        ),
    )
    rotary_base: float = field(
        default=10000.0,
        metadata=key_spec(
            "Base of the rotary frequencies (with position_embedding_type=rope).", gt=0, also=_RESUME_ONLY
        ),
    )
    normalization: str = field(
        default="layernorm",
        metadata=key_spec("layernorm (GPT-2) or rmsnorm (Llama).", choices=("layernorm", "rmsnorm"), also=_STRUCTURAL),
    )
    norm_epsilon: float = field(default=1e-5, metadata=key_spec("Epsilon of every LayerNorm / RMSNorm.", ge=0))
    activation: str = field(
        default="gelu",
        metadata=key_spec(
            "MLP activation: gelu, gelu_tanh (GPT-2's gelu_new) or swiglu (Llama; fc1 holds gate and up).",
            choices=("gelu", "gelu_tanh", "swiglu"),
            also=_STRUCTURAL,
        ),
    )
    tie_embeddings: bool = field(
        default=True,
        metadata=key_spec(
            "The output layer shares the input embedding's weight (under pp the first and last stage each hold a "
            "copy, summed after backward).",
            also=_STRUCTURAL,
        ),
    )
    add_bias_linear: bool = field(
        default=True,
        metadata=key_spec("Biases in the attention and MLP linears (false: Llama style).", also=_STRUCTURAL),
    )
    add_qkv_bias: bool = field(
        default=False,
        metadata=key_spec(
            "Biases in the q, k and v projections even with model.add_bias_linear=false (Qwen2, Qwen2-MoE; "
            "megatron-core's add_qkv_bias).",
            also=_STRUCTURAL,
        ),
    )
    qk_layernorm: bool = field(
        default=False,
        metadata=key_spec(
            "RMSNorm on the query and on the key projections' whole outputs (every head together, before rotary: "
            "OLMoE's q_norm / k_norm); parallel.tp_size=1 only. Needs model.normalization=rmsnorm.",
            also=_STRUCTURAL,
        ),
    )
    hidden_dropout: float = field(
        default=0.1,
        metadata=key_spec(
            "Dropout after attention and MLP (before the residual add), and on the embeddings.", ge=0, lt=1
        ),
    )
    attention_dropout: float = field(
        default=0.1,
        metadata=key_spec("Dropout on the attention probabilities (must be 0 with parallel.cp_size > 1).", ge=0, lt=1),
    )
    init_std: float = field(
        default=0.02,
        metadata=key_spec(
            "Standard deviation of the normal init; the output projections of each layer use "
            "init_std / sqrt(2 x num_layers).",
            ge=0,
        ),
    )
    fused_kernels: bool = field(
        default=False,
        metadata=key_spec(
            "Run the fused kernels of model/kernels/ (Triton on CUDA or with TRITON_INTERPRET=1, else their torch "
            "paths); docs/kernels.md."
        ),
    )
    # Each name is checked against model/kernels' KERNEL_NAMES in validate: model/kernels is imported only then.
    fused_kernel_names: list[str] | None = field(
        default=None,
        metadata=key_spec(
            "With fused_kernels: only these (norm, bias_gelu, swiglu, bias_dropout_add, rotary, grouped_mm, "
            "linear_cross_entropy). null: all."
        ),
    )

    # ---- Mixture of Experts (megatron-core's TransformerConfig names; model/moe/) ----------------------
    num_experts: int | None = field(
        default=None,
        metadata=key_spec(
            "Experts of each MoE layer (megatron-core's num_moe_experts). 0 or null: a dense model.",
            ge=0,
            also=_STRUCTURAL,
        ),
    )
    moe_layer_freq: int | list[int] = field(
        default=1,
        metadata=key_spec(
            "Which layers are MoE layers: n (every n-th: layers 0, n, 2n, ...), or a list of 0/1, one per layer "
            "(1: MoE; DeepSeek's first k dense layers are k zeros).",
            also=_STRUCTURAL,
        ),
    )
    moe_router_topk: int = field(
        default=2, metadata=key_spec("Experts each token is routed to (k); at most model.num_experts.", ge=1)
    )
    moe_ffn_hidden_size: int | None = field(
        default=None,
        metadata=key_spec(
            "Width of each routed expert's MLP. null: the dense MLP's width (model.ffn_hidden_size).",
            ge=1,
            also=_STRUCTURAL,
        ),
    )
    moe_shared_expert_ffn_hidden_size: int | None = field(
        default=None,
        metadata=key_spec(
            "Width of the shared expert, an MLP every token goes through beside its routed experts (several "
            "shared experts are one wider MLP). 0 or null: none.",
            ge=0,
            also=_STRUCTURAL,
        ),
    )
    moe_shared_expert_gate: bool = field(
        default=False,
        metadata=key_spec(
            "Multiply the shared expert's output by sigmoid(w . x), a learned gate per token (Qwen2-MoE).",
            also=_STRUCTURAL,
        ),
    )
    moe_router_score_function: str = field(
        default="softmax",
        metadata=key_spec(
            "Router scores: softmax (Mixtral, OLMoE, Qwen2-MoE) or sigmoid (DeepSeek-V3: the top-k sigmoid "
            "scores renormalised); computed in fp32 whatever the precision.",
            choices=("softmax", "sigmoid"),
        ),
    )
    moe_router_pre_softmax: bool = field(
        default=False,
        metadata=key_spec(
            "With softmax scores: the top-k of the softmax over all experts, not renormalised (OLMoE, Qwen2-MoE "
            "with norm_topk_prob=false). false: the softmax over the top-k logits (Mixtral). Needed for top-1."
        ),
    )
    moe_router_topk_scaling_factor: float | None = field(
        default=None,
        metadata=key_spec("Multiplies the routing weights (DeepSeek-V3's routed_scaling_factor). null: 1.", gt=0),
    )
    moe_router_load_balancing_type: str = field(
        default="aux_loss",
        metadata=key_spec(
            "aux_loss (the Switch Transformer's loss over the micro-batch), seq_aux_loss (the same per sequence, "
            "averaged: DeepSeek-V2/V3) or none; weighted by model.moe_aux_loss_coeff.",
            choices=("aux_loss", "seq_aux_loss", "none"),
        ),
    )
    moe_aux_loss_coeff: float = field(
        default=0.0,
        metadata=key_spec(
            "Coefficient of the load-balancing loss (1e-2 is a usual start); its gradient is added in backward, "
            "the logged lm loss leaves it out. 0: off.",
            ge=0,
        ),
    )
    moe_z_loss_coeff: float | None = field(
        default=None,
        metadata=key_spec(
            "Coefficient of the router z-loss, the mean squared logsumexp of the router logits (ST-MoE; 1e-3 is "
            "a usual start). null: off.",
            ge=0,
        ),
    )
    moe_router_enable_expert_bias: bool = field(
        default=False,
        metadata=key_spec(
            "Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the selection only "
            "(not the weights), moved by model.moe_router_bias_update_rate after each step towards equal load. "
            "Needs model.moe_router_score_function=sigmoid.",
            also=_STRUCTURAL,
        ),
    )
    moe_router_bias_update_rate: float = field(
        default=1e-3, metadata=key_spec("Step of the expert bias per update (DeepSeek-V3's 1e-3).", ge=0)
    )
    moe_expert_capacity_factor: float | None = field(
        default=None,
        metadata=key_spec(
            "Each expert takes at most ceil(tokens x top_k / experts x factor) tokens of a micro-batch; the rest "
            "of its tokens are dropped (they pass by the residual). null: dropless.",
            gt=0,
        ),
    )
    moe_token_drop_policy: str = field(
        default="probs",
        metadata=key_spec(
            "With a capacity factor, which tokens an expert keeps: probs (its highest routing weights) or "
            "position (the earliest in the micro-batch).",
            choices=("probs", "position"),
        ),
    )
    moe_pad_expert_input_to_capacity: bool = field(
        default=False,
        metadata=key_spec(
            "With a capacity factor, every expert computes exactly its capacity in rows (the rows of tokens not "
            "routed to it weigh 0): fixed shapes."
        ),
    )

    def validate(self) -> None:
        """Checks local to this section; each error names the key and its value."""
        check_declared(self, "model")
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
        if self.max_positions < self.seq_length:
            raise ValueError(
                f"model.max_position_embeddings={self.max_position_embeddings} is smaller than "
                f"model.seq_length={self.seq_length}"
            )
        if self.qk_layernorm and self.normalization != "rmsnorm":
            raise ValueError(f"model.qk_layernorm=true needs model.normalization=rmsnorm, got {self.normalization}")
        self._validate_kernels()
        self._validate_moe()
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dimension, got {self.head_dim}")

    def kernel_selection(self) -> KernelSelection:
        """The fused kernels fused_kernels and fused_kernel_names choose (model/kernels), their ops not yet
        registered: a model build calls `.registered()` on it once."""
        return _kernels().KernelSelection.of(self.fused_kernels, self.fused_kernel_names)

    def _validate_kernels(self) -> None:
        if self.fused_kernel_names is None:
            return
        if not self.fused_kernels:
            raise ValueError(f"model.fused_kernel_names={self.fused_kernel_names} needs model.fused_kernels=true")
        for name in self.fused_kernel_names:
            if name not in _kernels().KERNEL_NAMES:
                raise ValueError(
                    f"model.fused_kernel_names: {name!r} is not one of {', '.join(_kernels().KERNEL_NAMES)}"
                )

    def _validate_moe(self) -> None:
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            if len(freq) != self.num_layers or any(item not in (0, 1) or isinstance(item, bool) for item in freq):
                raise ValueError(
                    f"model.moe_layer_freq={freq} must be one 0 or 1 per layer (model.num_layers={self.num_layers})"
                )
        elif freq < 1:
            raise ValueError(f"model.moe_layer_freq={freq} must be >= 1 (every n-th layer) or a list of 0/1")
        if not self.num_experts:
            return
        if self.moe_router_topk > self.num_experts:
            raise ValueError(
                f"model.moe_router_topk={self.moe_router_topk} is more than model.num_experts={self.num_experts}"
            )
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError(
                "model.moe_router_enable_expert_bias=true needs model.moe_router_score_function=sigmoid, got "
                f"{self.moe_router_score_function}"
            )
        if (
            self.moe_router_topk == 1
            and self.moe_router_score_function == "softmax"
            and not self.moe_router_pre_softmax
        ):
            # A softmax over one logit is 1 whatever the logit: the router would get no gradient.
            raise ValueError("model.moe_router_topk=1 with softmax scores needs model.moe_router_pre_softmax=true")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("model.moe_pad_expert_input_to_capacity=true needs model.moe_expert_capacity_factor")

    # ---- derived sizes ----------------------------------------------------------------------
    @property
    def qkv_bias(self) -> bool:
        """Whether the qkv projection has a bias (model.add_bias_linear or model.add_qkv_bias)."""
        return self.add_bias_linear or self.add_qkv_bias

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
    def moe_ffn_size(self) -> int:
        """Width of each routed expert's MLP."""
        return self.moe_ffn_hidden_size or self.ffn_size

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether global layer `layer_id` holds an MoE layer in place of the dense MLP (model.moe_layer_freq)."""
        if not self.num_experts:
            return False
        if isinstance(self.moe_layer_freq, list):
            return self.moe_layer_freq[layer_id] == 1
        return layer_id % self.moe_layer_freq == 0

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Vocabulary padded to a multiple of make_vocab_size_divisible_by * tp (Megatron's rule)."""
        if self.vocab_size is None:
            raise ValueError("model.vocab_size is unknown: set it or let the tokenizer fill it in")
        multiple = self.make_vocab_size_divisible_by * tp_size
        return multiple * math.ceil(self.vocab_size / multiple)
