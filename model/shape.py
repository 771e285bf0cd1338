"""The model's shape, declared once: the GEMMs and parameters of a layer, the embedding and the head.

Everything that counts the model derives from here: the trainer's FLOPs per iteration (console, metrics.jsonl,
TensorBoard), planner/ (GEMM times, parameters per rank) and tools/model_stats.py. It mirrors model/gpt.py;
tests/model/test_shape.py checks the parameters against the built model and the FLOPs against
torch.utils.flop_counter on a real forward and backward.

FLOPs are 2 x the multiply-adds of every GEMM, the two batched matmuls of attention (q k^T and scores x v,
counted over the full s x s as the paper does, although causal attention needs half) included; the backward is
twice the forward. For the paper's GPT-3 style (GeLU, 4h MLP, one kv head per query head) this gives its
72 B s l h^2 (1 + s/6h + V/12lh), and with full recomputation of the layers its equation (3),
96 B s l h^2 (1 + s/6h + V/16lh).

A Mixture-of-Experts layer (model.num_experts, on the layers model.moe_layer_freq selects) counts what a token
computes (`moe_gemms`): the router [h -> E], its top_k routed experts' fc1 and fc2, the shared expert and its
gate; its parameters count all E experts (`moe_gemms(cfg, cfg.num_experts)`), `active_params` only top_k.
Permute / unpermute and the routing's softmax are not matrix multiplies and are not counted. Under expert
parallelism (`ep_size`) each ep rank holds E / ep whole routed experts (not split by tp), replicated over its tp
ranks and its expert-dp group; the router and the shared expert stay whole on every rank. The counts that take
`ep_size` say so (`layer_params`, `rank_params`, `routed_expert_params`, `chunk_parameters`: ParamShape.expert).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from model.config import ModelConfig
from model.rank_spec import Recompute


@dataclass(frozen=True)
class Gemm:
    """One weight GEMM: [tokens, in_features] x [in_features, out_features] (+ bias [out_features]).

    `split` says how tensor parallelism cuts it: "column" splits the output (and the bias), "row" the input
    (its bias stays whole on every rank), "vocab" the vocabulary rows of the output layer, "none" nothing
    (the MoE layer's GEMMs: replicated over tp).
    """

    name: str
    in_features: int
    out_features: int
    bias: bool
    split: str

    @property
    def weights(self) -> int:
        """Weight elements, equal to the multiply-adds per token."""
        return self.in_features * self.out_features

    def params(self, tp_size: int = 1) -> int:
        """Weight and bias elements on one tp rank."""
        if self.split == "none":
            return self.weights + (self.out_features if self.bias else 0)
        bias = 0
        if self.bias:
            bias = self.out_features // tp_size if self.split == "column" else self.out_features
        return self.weights // tp_size + bias


def layer_gemms(cfg: ModelConfig) -> tuple[Gemm, ...]:
    """The four weight GEMMs of one transformer layer, in forward order.

    qkv: (heads + 2 * query groups) * head_dim outputs (grouped-query attention shares k and v per group);
    fc1: 2 * ffn outputs under SwiGLU (gate and up halves), else ffn.
    """
    h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.add_bias_linear
    fc1_out = cfg.ffn_size * (2 if cfg.activation == "swiglu" else 1)
    return (
        Gemm("qkv", h, (cfg.num_attention_heads + 2 * cfg.query_groups) * d, cfg.qkv_bias, "column"),
        Gemm("proj", cfg.num_attention_heads * d, h, bias, "row"),
        Gemm("fc1", h, fc1_out, bias, "column"),
        Gemm("fc2", cfg.ffn_size, h, bias, "row"),
    )


def moe_gemms(cfg: ModelConfig, experts: int) -> tuple[Gemm, ...]:
    """The GEMMs of an MoE layer in place of fc1 and fc2, `experts` routed experts side by side (top_k: what one
    token computes; num_experts: every weight): the router [h -> E], the routed experts' fc1 [h -> experts x f
    (x2 SwiGLU)] and fc2 [f -> experts x h] (per expert, biases [f(x2)] and [h]), the shared expert's fc1 and
    fc2 and its gate [h -> 1]. Replicated over tp (model/gpt.build_moe_layer)."""
    h, f, bias = cfg.hidden_size, cfg.moe_ffn_size, cfg.add_bias_linear
    stacked = 2 if cfg.activation == "swiglu" else 1
    gemms = [
        Gemm("router", h, cfg.num_experts or 0, bias, "none"),
        Gemm("experts.fc1", h, experts * f * stacked, bias, "none"),
        Gemm("experts.fc2", f, experts * h, bias, "none"),
    ]
    shared = cfg.moe_shared_expert_ffn_hidden_size
    if shared:
        gemms += [
            Gemm("shared_experts.fc1", h, shared * stacked, bias, "none"),
            Gemm("shared_experts.fc2", shared, h, bias, "none"),
        ]
        if cfg.moe_shared_expert_gate:
            gemms.append(Gemm("shared_experts.gate", h, 1, False, "none"))
    return tuple(gemms)


def layer_compute_gemms(cfg: ModelConfig, layer_id: int | None = None) -> tuple[Gemm, ...]:
    """What one token goes through in layer `layer_id`: `layer_gemms`, with an MoE layer's active GEMMs
    (`moe_gemms(cfg, top_k)`) in place of fc1 and fc2 where model.moe_layer_freq puts one (None: dense)."""
    gemms = layer_gemms(cfg)
    if layer_id is None or not cfg.is_moe_layer(layer_id):
        return gemms
    return gemms[:2] + moe_gemms(cfg, cfg.moe_router_topk)


def output_gemm(cfg: ModelConfig, padded_vocab: int) -> Gemm:
    """The logits GEMM [tokens, h] x [h, V] over the padded vocabulary (every padded column is computed)."""
    return Gemm("output_layer", cfg.hidden_size, padded_vocab, False, "vocab")


def norm_params(cfg: ModelConfig) -> int:
    """One norm: weight and bias for LayerNorm, weight only for RMSNorm (replicated over tp)."""
    return 2 * cfg.hidden_size if cfg.normalization == "layernorm" else cfg.hidden_size


# ---- FLOPs ---------------------------------------------------------------------------------------
def layer_gemm_flops(cfg: ModelConfig, tokens: float, tp_size: int = 1, layer_id: int | None = None) -> list[float]:
    """Forward FLOPs of each weight GEMM of layer `layer_id` (None: a dense layer) over `tokens` tokens, on one
    tp rank (the MoE GEMMs, replicated, are divided too: each tp rank's share of the model's FLOPs)."""
    return [2.0 * tokens * gemm.weights / tp_size for gemm in layer_compute_gemms(cfg, layer_id)]


def attention_matmul_flops(cfg: ModelConfig, tokens: float, seq_length: int, tp_size: int = 1) -> float:
    """Forward FLOPs of ONE of attention's batched matmuls (q k^T or scores x v) of one layer, on one tp rank:
    per token and head, s dot products of length head_dim (full s^2, as the paper counts)."""
    return 2.0 * tokens * seq_length * cfg.num_attention_heads * cfg.head_dim / tp_size


def layer_forward_flops(cfg: ModelConfig, tokens: float, seq_length: int, layer_id: int | None = None) -> float:
    """Forward FLOPs of one whole layer (`layer_id`; None: dense): its GEMMs and attention's two batched
    matmuls."""
    gemms = sum(layer_gemm_flops(cfg, tokens, layer_id=layer_id))
    return gemms + 2 * attention_matmul_flops(cfg, tokens, seq_length)


@dataclass(frozen=True)
class IterationFlops:
    """FLOPs of one training iteration of a global batch.

    `model`: forward + backward (3 x forward), recomputation excluded: MFU's numerator, as PaLM defines it.
    `with_recompute`: plus the forward that recomputation repeats: the paper's achieved FLOPs (equation 3).
    """

    model: float
    with_recompute: float


def recomputed_layers(cfg: ModelConfig, recompute: Recompute, num_chunks: int) -> int:
    """Layers whose forward full recomputation repeats over the `num_chunks` (pp x vp) model chunks of equal
    length: those GPTModel checkpoints in each (`recompute.layer_ids`)."""
    return len(recompute.layer_ids(range(cfg.num_layers // num_chunks))) * num_chunks


def iteration_flops(
    cfg: ModelConfig, padded_vocab: int, global_batch_size: int, recompute: Recompute, num_chunks: int = 1
) -> IterationFlops:
    """Training FLOPs of one iteration of `global_batch_size` sequences: 3 x the forward, plus one more forward
    of what `recompute` repeats (full: the recomputed layers, never the logits; selective: attention's two
    batched matmuls in every layer)."""
    s = cfg.seq_length
    tokens = float(global_batch_size * s)
    layers = [layer_forward_flops(cfg, tokens, s, layer_id) for layer_id in range(cfg.num_layers)]
    forward = sum(layers) + 2.0 * tokens * output_gemm(cfg, padded_vocab).weights
    if recompute.mode == "selective":
        recomputed = cfg.num_layers * 2 * attention_matmul_flops(cfg, tokens, s)
    else:
        # the chunks are the num_chunks contiguous blocks of layers (in whatever order stages hold them)
        per_chunk = cfg.num_layers // num_chunks
        recomputed = sum(
            layers[layer_id]
            for first in range(0, per_chunk * num_chunks, per_chunk)
            for layer_id in recompute.layer_ids(range(first, first + per_chunk))
        )
    return IterationFlops(model=3.0 * forward, with_recompute=3.0 * forward + recomputed)


# ---- parameters ----------------------------------------------------------------------------------
def moe_layer_ids(cfg: ModelConfig) -> list[int]:
    """The global layers that hold an MoE layer in place of the dense MLP (model.moe_layer_freq); none for a
    dense model."""
    return [layer_id for layer_id in range(cfg.num_layers) if cfg.is_moe_layer(layer_id)]


def layer_params(
    cfg: ModelConfig, tp_size: int = 1, layer_id: int | None = None, active: bool = False, ep_size: int = 1
) -> int:
    """Parameters of transformer layer `layer_id` (None: a dense layer) on one (tp, ep) rank: column weights
    and biases and row weights split, row biases, the two norms and an MoE layer's weights replicated over tp,
    of its routed experts the E / ep of the ep rank (`active`: only top_k, what one token goes through)."""
    gemms = layer_gemms(cfg)
    if layer_id is not None and cfg.is_moe_layer(layer_id):
        experts = cfg.moe_router_topk if active else cast(int, cfg.num_experts) // ep_size
        gemms = gemms[:2] + moe_gemms(cfg, experts)
    qk_norms = (cfg.num_attention_heads + cfg.query_groups) * cfg.head_dim if cfg.qk_layernorm else 0
    return sum(gemm.params(tp_size) for gemm in gemms) + 2 * norm_params(cfg) + qk_norms


def count_moe_layers(cfg: ModelConfig, layer_ids: Sequence[int]) -> int:
    """How many of `layer_ids` hold an MoE layer (none without experts, without looking at each: the size check
    counts models of millions of layers)."""
    if not cfg.num_experts:
        return 0
    return sum(1 for layer_id in layer_ids if cfg.is_moe_layer(layer_id))


def layers_params(cfg: ModelConfig, layer_ids: Sequence[int], tp_size: int = 1, ep_size: int = 1) -> int:
    """Parameters of the transformer layers `layer_ids` on one (tp, ep) rank: each kind of layer (dense, MoE)
    counted once and multiplied, so that the count costs no more for a million layers than for one."""
    moe = count_moe_layers(cfg, layer_ids)
    total = (len(layer_ids) - moe) * layer_params(cfg, tp_size, ep_size=ep_size)
    if moe:
        first_moe = next(layer_id for layer_id in layer_ids if cfg.is_moe_layer(layer_id))
        total += moe * layer_params(cfg, tp_size, first_moe, ep_size=ep_size)
    return total


def routed_expert_params(cfg: ModelConfig, layer_ids: Sequence[int], ep_size: int = 1) -> int:
    """Parameters of the routed experts that one ep rank holds in layers `layer_ids`: E / ep experts' fc1 and
    fc2 (and biases) of each MoE layer among them, whole on every tp rank. What expert parallelism places
    and the expert-dp group reduces; the rest of a rank's parameters are replicated over dp x cp."""
    if not cfg.num_experts:
        return 0
    local = moe_gemms(cfg, cfg.num_experts // ep_size)
    per_layer = sum(gemm.params() for gemm in local if gemm.name.startswith("experts."))
    return per_layer * count_moe_layers(cfg, layer_ids)


def embedding_params(cfg: ModelConfig, tp_size: int = 1) -> int:
    """Word embedding shard (vocabulary rows split over tp) plus learned position embeddings (replicated;
    rotary positions have no parameters), held by virtual stage 0."""
    vocab_local = cfg.padded_vocab_size(tp_size) // tp_size
    positions = cfg.max_positions * cfg.hidden_size if cfg.position_embedding_type == "learned" else 0
    return vocab_local * cfg.hidden_size + positions


def head_params(cfg: ModelConfig, tp_size: int, holds_embedding: bool) -> int:
    """Final norm plus the output layer shard on the last virtual stage; a tied output layer on the stage
    that holds the embedding is the embedding itself (counted there)."""
    shared = cfg.tie_embeddings and holds_embedding
    output = 0 if shared else output_gemm(cfg, cfg.padded_vocab_size(tp_size)).params(tp_size)
    return norm_params(cfg) + output


def rank_params(
    cfg: ModelConfig,
    tp_size: int,
    pp_size: int,
    chunk_roles: list[tuple[bool, bool]],
    ep_size: int = 1,
    layer_ids: Sequence[int] | None = None,
) -> int:
    """Parameters held by one (tp rank, ep rank, pp rank): its layers, plus the embedding and the head of the
    chunks that hold them: `chunk_roles` is (pre_process, post_process) per model chunk of the rank
    (parallel/pipeline/stages.chunk_roles). A head in another chunk than the embedding keeps its own copy of a
    tied table. `layer_ids`: the rank's global layers; None gives it num_layers / pp of the model's average
    layer (exact for pp = 1 and for models whose layers are all alike). MoE layers hold E / ep routed experts."""
    if layer_ids is None:
        total = layers_params(cfg, range(cfg.num_layers), tp_size, ep_size) // pp_size
    else:
        total = layers_params(cfg, layer_ids, tp_size, ep_size)
    for pre, post in chunk_roles:
        total += (embedding_params(cfg, tp_size) if pre else 0) + (head_params(cfg, tp_size, pre) if post else 0)
    return total


def fsdp_shard_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """[first, end) of the dim-0 rows that shard `index` of `shards` holds under FSDP2's Shard(0), torch.chunk's
    split: ceil(rows / shards) rows per shard, the last shards fewer or none. The trainer (parallel/fsdp.py)
    and the planner (planner/sharded.py) both read it."""
    per_shard = -(-rows // shards)
    first = min(index * per_shard, rows)
    return first, min(first + per_shard, rows)


@dataclass(frozen=True)
class ParamShape:
    """One parameter of a chunk as one tp rank holds it, in the order `chunk.parameters()` yields it."""

    name: str  # the chunk's parameter name (`layers.5.mlp.fc1.weight`, global layer index)
    numel: int  # elements on one tp rank
    shared_embedding: bool = False  # a tied-embedding copy on a chunk without the other end
    sequence_parallel: bool = False  # replicated over tp, gradient partial under sequence parallelism
    rows: int = 0  # dim 0 on one tp rank (what FSDP shards and pads); 0: a 1-D parameter, numel rows
    expert: bool = False  # the routed experts' weights stacked over the E / ep experts of one ep rank

    @property
    def dim0(self) -> int:
        """Rows of the parameter on one tp rank (dim 0: what FSDP splits)."""
        return self.rows or self.numel

    def padded_numel(self, shards: int) -> int:
        """Elements FSDP moves for it over `shards` ranks: every shard padded to the first one's rows, the most."""
        first, end = fsdp_shard_rows(self.dim0, shards, 0)
        return (end - first) * shards * (self.numel // self.dim0)


def _norm_parameters(cfg: ModelConfig, prefix: str, sp: bool) -> list[ParamShape]:
    kinds = ("weight", "bias") if cfg.normalization == "layernorm" else ("weight",)
    return [ParamShape(f"{prefix}.{kind}", cfg.hidden_size, sequence_parallel=sp) for kind in kinds]


def _qk_norm_parameters(cfg: ModelConfig, prefix: str) -> list[ParamShape]:
    """model.qk_layernorm's RMSNorm weights over the whole q [n x d] and k [g x d] (tp=1 only)."""
    if not cfg.qk_layernorm:
        return []
    d = cfg.head_dim
    return [
        ParamShape(f"{prefix}.q_norm.weight", cfg.num_attention_heads * d),
        ParamShape(f"{prefix}.k_norm.weight", cfg.query_groups * d),
    ]


def _gemm_parameters(gemm: Gemm, prefix: str, tp_size: int, sp: bool) -> list[ParamShape]:
    """Weight and bias of one GEMM on one tp rank; a row-parallel bias is replicated (partial grad under SP)."""
    # nn.Linear's weight is [out, in]: a column split cuts its rows, a row split its columns
    rows = gemm.out_features // tp_size if gemm.split == "column" else gemm.out_features
    found = [ParamShape(f"{prefix}.weight", gemm.weights // tp_size, rows=rows)]
    if gemm.bias:
        column = gemm.split == "column"
        bias = gemm.out_features // tp_size if column else gemm.out_features
        found.append(ParamShape(f"{prefix}.bias", bias, sequence_parallel=sp and not column))
    return found


def _layer_parameters(cfg: ModelConfig, layer: int, tp_size: int, sp: bool, ep_size: int) -> list[ParamShape]:
    """One layer's parameters in registration order: input norm, qkv, proj, post-attention norm, then fc1 and
    fc2, or an MoE layer's (`_moe_parameters`)."""
    qkv, proj, fc1, fc2 = layer_gemms(cfg)
    prefix = f"layers.{layer}"
    attention = (
        _norm_parameters(cfg, f"{prefix}.input_norm", sp)
        + _gemm_parameters(qkv, f"{prefix}.attention.qkv", tp_size, sp)
        + _gemm_parameters(proj, f"{prefix}.attention.proj", tp_size, sp)
        + _qk_norm_parameters(cfg, f"{prefix}.attention")
        + _norm_parameters(cfg, f"{prefix}.post_attention_norm", sp)
    )
    if cfg.is_moe_layer(layer):
        return attention + _moe_parameters(cfg, f"{prefix}.mlp", sp, ep_size)
    return (
        attention
        + _gemm_parameters(fc1, f"{prefix}.mlp.fc1", tp_size, sp)
        + _gemm_parameters(fc2, f"{prefix}.mlp.fc2", tp_size, sp)
    )


def _moe_parameters(cfg: ModelConfig, prefix: str, sp: bool, ep_size: int) -> list[ParamShape]:
    """An MoE layer's parameters in registration order (model/moe/layer.py), whole on every tp rank (partial
    gradients under sequence parallelism): router weight [E, h] (and bias), the stacked experts' fc1 [E/ep,
    f(x2), h], fc2 [E/ep, h, f] (and biases [E/ep, f(x2)], [E/ep, h]), the shared expert's gate, fc1 and fc2."""
    h, f, experts = cfg.hidden_size, cfg.moe_ffn_size, cast(int, cfg.num_experts)
    local = experts // ep_size
    fc1_rows = f * (2 if cfg.activation == "swiglu" else 1)
    found = [ParamShape(f"{prefix}.router.weight", experts * h, sequence_parallel=sp, rows=experts)]
    if cfg.add_bias_linear:
        found.append(ParamShape(f"{prefix}.router.bias", experts, sequence_parallel=sp))
    stacked = [("fc1_weight", fc1_rows * h), ("fc2_weight", h * f)]
    stacked += [("fc1_bias", fc1_rows), ("fc2_bias", h)] if cfg.add_bias_linear else []
    for name, per_expert in stacked:
        found.append(
            ParamShape(f"{prefix}.experts.{name}", local * per_expert, sequence_parallel=sp, rows=local, expert=True)
        )
    if cfg.moe_shared_expert_ffn_hidden_size:
        if cfg.moe_shared_expert_gate:  # the module's own parameter: before its submodules' (named_parameters)
            found.append(ParamShape(f"{prefix}.shared_experts.gate_weight", h, sequence_parallel=sp, rows=1))
        for gemm in moe_gemms(cfg, experts)[3:5]:  # the shared expert's fc1, fc2 as nn.Linear
            found += [
                ParamShape(f"{prefix}.{gemm.name}.weight", gemm.weights, sequence_parallel=sp, rows=gemm.out_features)
            ]
            if gemm.bias:
                found.append(ParamShape(f"{prefix}.{gemm.name}.bias", gemm.out_features, sequence_parallel=sp))
    return found


def chunk_parameters(
    cfg: ModelConfig,
    tp_size: int,
    layer_ids: Sequence[int],
    pre_process: bool,
    post_process: bool,
    sequence_parallel: bool = False,
    ep_size: int = 1,
) -> list[ParamShape]:
    """The parameters of one model chunk on one (tp, ep) rank, in `chunk.parameters()` order (a tied output
    layer on the embedding's chunk is the embedding: listed once; an MoE layer's stacked experts the E / ep of
    the ep rank). What the gradient buckets of parallel/data_parallel.py are cut from; tests/model/test_shape.py
    checks it against built chunks."""
    sp = sequence_parallel and tp_size > 1
    vocab_local = cfg.padded_vocab_size(tp_size) // tp_size
    tied_copy = cfg.tie_embeddings and pre_process != post_process
    found = []
    if pre_process:
        found.append(
            ParamShape("embedding.word_embeddings.weight", vocab_local * cfg.hidden_size, tied_copy, rows=vocab_local)
        )
        if cfg.position_embedding_type == "learned":
            positions = cfg.max_positions
            found.append(
                ParamShape("embedding.position_embeddings.weight", positions * cfg.hidden_size, rows=positions)
            )
    for layer in layer_ids:
        found += _layer_parameters(cfg, layer, tp_size, sp, ep_size)
    if post_process:
        found += _norm_parameters(cfg, "final_norm", sp)
        if not (cfg.tie_embeddings and pre_process):
            found.append(ParamShape("output_layer.weight", vocab_local * cfg.hidden_size, tied_copy, rows=vocab_local))
    return found


def total_params(cfg: ModelConfig) -> int:
    """The whole model counted once (tied embedding once), as on one process."""
    return rank_params(cfg, 1, 1, [(True, True)])


def active_params(cfg: ModelConfig) -> int:
    """The parameters one token goes through: `total_params` with top_k of each MoE layer's routed experts
    (the router and the shared expert whole); the total for a dense model."""
    unused = sum(
        layer_params(cfg, 1, layer_id) - layer_params(cfg, 1, layer_id, active=True) for layer_id in moe_layer_ids(cfg)
    )
    return total_params(cfg) - unused
