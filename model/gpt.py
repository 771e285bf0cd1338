"""A GPT decoder in plain PyTorch: GPT-2/3 style or Llama style, chosen by ModelConfig.

Activations flow as [s, b, h] (sequence first, as in Megatron) so that sequence parallelism can shard dim 0.
The model knows nothing of parallelism: everything a rank builds or runs differently is one description handed
in at construction (`RankSpec`, model/rank_spec.py): the factories of its split layers and the tp hooks (the
sequence-parallel split after the embedding, the vocab-parallel loss, the fused loss's input handling and
reductions), the context-parallel attention, the random stream of each dropout, activation recomputation and
the fused kernels, the ranks sharing a micro-batch's tokens for the MoE router. The modules are built from it once; nothing replaces or wraps them afterwards. Norms, MLP
activation, rotary, bias-dropout-add and the loss go through model/kernels' dispatch functions (fused kernels
when selected). A GPTModel can hold any contiguous block of layers with or without the embedding
(`pre_process`) and the head (`post_process`), which is how pipeline stages and virtual chunks are cut. Layer
modules are keyed by their global index, so parameter names (`layers.5.mlp.fc1.weight`) are the same in every
layout. The layers model.moe_layer_freq selects hold a Mixture-of-Experts layer (model/moe/) as their `mlp`
(`layers.4.mlp.router.weight`, `layers.4.mlp.experts.fc1_weight` [E, f, h], ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from model import kernels
from model.config import ModelConfig
from model.kernels.reference import mask_vocab_padding
from model.kv_cache import KVCache, LayerKVCache
from model.moe.layer import MoELayer
from model.param_info import param_info, set_param_info
from model.rank_spec import CheckpointFn, RankSpec, RNGFork
from model.tp_hooks import AttentionFn, TensorParallelHooks, plain_embedding

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin [s, b, 1, d]


def build_norm(cfg: ModelConfig, tp: TensorParallelHooks) -> nn.Module:
    """LayerNorm or RMSNorm over h; under sequence parallelism it sees s/tp tokens, so its parameters'
    gradients are partial (ParamInfo.sequence_parallel: summed over tp after backward)."""
    norm: nn.Module
    if cfg.normalization == "rmsnorm":
        norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
    else:
        norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
    if tp.sequence_parallel:
        for param in norm.parameters():
            set_param_info(param, sequence_parallel=True)
    return norm


class StreamDropout(nn.Dropout):
    """nn.Dropout drawing its mask inside `rng_fork` (a tp rank's own stream, parallel/random.py); no
    parameters, so the model's parameter names are those of one process."""

    def __init__(self, p: float, rng_fork: RNGFork):
        super().__init__(p)
        self.rng_fork = rng_fork

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.rng_fork():
            return super().forward(x)


def build_dropout(p: float, rng_fork: RNGFork | None) -> nn.Dropout:
    """Dropout on the default generator, or on the stream `rng_fork` opens."""
    return nn.Dropout(p) if rng_fork is None else StreamDropout(p, rng_fork)


def rotary_cos_sin(
    position_ids: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [s, b, 1, d] for positions [b, s] (rotate-half layout, as Megatron and HF Llama)."""
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    )
    angles = position_ids.t().float()[..., None] * inv_freq  # [s, b, d/2]
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]  # [s, b, 1, d]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v through scaled_dot_product_attention, or through the context-parallel
    attention when one is given (ContextParallelHooks); the part selective recompute redoes. With `rng_fork`
    (DropoutStreams.attention) it runs inside that stream: its dropout acts on this tp rank's heads."""

    def __init__(
        self,
        attention_dropout: float,
        context_parallel_attention: AttentionFn | None = None,
        rng_fork: RNGFork | None = None,
    ):
        super().__init__()
        self.dropout_p = attention_dropout
        self.context_parallel_attention = context_parallel_attention
        self.rng_fork = rng_fork

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        # q [s, b, nq, d], k/v [s, b, nkv, d] -> context [s, b, nq * d]
        if self.rng_fork is None:
            return self._attend(q, k, v, attention_mask)
        with self.rng_fork():
            return self._attend(q, k, v, attention_mask)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        if self.context_parallel_attention is not None:
            return self.context_parallel_attention(q, k, v, attention_mask)
        s, b, nq, d = q.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attention_mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=attention_mask is None,
            enable_gqa=k.shape[1] != nq,
        )
        return context.permute(2, 0, 1, 3).reshape(s, b, nq * d)


class SelfAttention(nn.Module):
    """Fused QKV projection laid out per query group ([q x heads_per_group, k, v] for each group), so that a
    contiguous split of its output dimension gives each tensor-parallel rank whole groups."""

    def __init__(self, cfg: ModelConfig, spec: RankSpec):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.heads_per_group = cfg.num_attention_heads // cfg.query_groups
        qkv_size = cfg.query_groups * (self.heads_per_group + 2) * cfg.head_dim
        layers = spec.tp.layers
        self.qkv = layers.column_linear(cfg.hidden_size, qkv_size, cfg.qkv_bias, 1)
        self.core = CoreAttention(cfg.attention_dropout, spec.cp.attention, spec.dropout.attention)
        self.proj = layers.row_linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, cfg.add_bias_linear)
        self.q_norm = self.k_norm = None
        if cfg.qk_layernorm:
            if spec.tp.tp_size > 1:
                # The norm's statistics span every head, and a tp rank holds only its own heads.
                raise ValueError(f"model.qk_layernorm=true needs parallel.tp_size=1, got {spec.tp.tp_size}")
            self.q_norm = nn.RMSNorm(cfg.num_attention_heads * cfg.head_dim, eps=cfg.norm_epsilon)
            self.k_norm = nn.RMSNorm(cfg.query_groups * cfg.head_dim, eps=cfg.norm_epsilon)
        self.recompute_core = spec.recompute.mode == "selective"
        self.checkpoint_fn: CheckpointFn | None = spec.recompute.checkpoint_fn
        self.kernels = spec.kernels

    # Twin of TransformerLayer.forward's signature: the layer hands its arguments straight through.
    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary | None,
        attention_mask: torch.Tensor | None,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        mixed = self.qkv(x)  # [s, b, groups_local * (hpg + 2) * d]
        s, b = mixed.shape[:2]
        d, hpg = self.head_dim, self.heads_per_group
        mixed = mixed.view(s, b, -1, (hpg + 2) * d)  # [s, b, groups_local, (hpg + 2) * d]
        q, k, v = torch.split(mixed, [hpg * d, d, d], dim=-1)
        q = q.reshape(s, b, -1, d)  # [s, b, heads_local, d]
        if self.q_norm is not None and self.k_norm is not None:  # over all heads at once: [s, b, n * d]
            q = self.q_norm(q.reshape(s, b, -1)).view_as(q)
            k = self.k_norm(k.reshape(s, b, -1)).view_as(k)
        if rotary is not None:
            q, k = kernels.rotary_qk(q, k, rotary[0], rotary[1], self.kernels)
        if kv_cache is not None:  # incremental decoding: attend over every cached position too
            k, v, attention_mask = kv_cache.update(k, v)
        if self.recompute_core and self.training and self.checkpoint_fn is not None:
            context = self.checkpoint_fn(self.core, q, k, v, attention_mask)
        else:
            context = self.core(q, k, v, attention_mask)
        return self.proj(context)


class MLP(nn.Module):
    """h -> ffn -> h with GeLU, or SwiGLU with fc1 producing [gate, up] halves."""

    def __init__(self, cfg: ModelConfig, spec: RankSpec):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        self.gelu_approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"  # GPT-2's gelu_new
        stacked = 2 if self.swiglu else 1  # [gate; up]
        layers = spec.tp.layers
        self.fc1 = layers.column_linear(cfg.hidden_size, cfg.ffn_size * stacked, cfg.add_bias_linear, stacked)
        self.fc2 = layers.row_linear(cfg.ffn_size, cfg.hidden_size, cfg.add_bias_linear)
        self.kernels = spec.kernels

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[s, b, h] -> (output [s, b, h], fc2's bias when it is left to the fused bias-dropout-add, else None)."""
        y = kernels.linear_activation(self.fc1, x, self.swiglu, self.kernels, self.gelu_approximate)  # [s, b, ffn(/tp)]
        if kernels.fuses_bias_dropout_add(self.kernels, y.device):
            return kernels.linear_skip_bias(self.fc2, y)
        return self.fc2(y), None


def build_moe_layer(cfg: ModelConfig, spec: RankSpec) -> MoELayer:
    """The MoE layer in place of the MLP. Its router and experts are replicated over tp (megatron-core's
    expert_tensor_parallel_size=1): without sequence parallelism every tp rank routes the same tokens and
    computes the same output and gradients; with it each tp rank routes its own s/tp tokens, so the
    parameters' gradients are partial (ParamInfo.sequence_parallel: summed over tp after backward, counted
    once in the gradient norm) and the load-balancing losses count over the token group (`spec.moe_tokens`).
    Under expert parallelism (`spec.expert_exchange`) the layer holds its ep rank's experts only; its experts
    run the grouped_mm kernel when the spec's kernels select it."""
    moe = MoELayer(cfg, expert_exchange=spec.expert_exchange, token_group=spec.moe_tokens, kernels=spec.kernels)
    if spec.tp.sequence_parallel:
        for param in moe.parameters():
            set_param_info(param, sequence_parallel=True)
    return moe


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then + drop(mlp(norm(.))); the mlp is an MoE layer on the
    layers model.moe_layer_freq selects (`layer_id`: the global index)."""

    def __init__(self, cfg: ModelConfig, spec: RankSpec, layer_id: int):
        super().__init__()
        self.input_norm = build_norm(cfg, spec.tp)
        self.attention = SelfAttention(cfg, spec)
        self.post_attention_norm = build_norm(cfg, spec.tp)
        self.mlp: MLP | MoELayer = build_moe_layer(cfg, spec) if cfg.is_moe_layer(layer_id) else MLP(cfg, spec)
        self.hidden_dropout = build_dropout(cfg.hidden_dropout, spec.dropout.hidden)
        self.hidden_dropout_p = cfg.hidden_dropout
        self.kernels = spec.kernels

    # Twin of SelfAttention.forward's signature, which receives these arguments as they are.
    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary | None,
        attention_mask: torch.Tensor | None,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        attention_out = self.attention(kernels.norm(self.input_norm, x, self.kernels), rotary, attention_mask, kv_cache)
        x = self._dropout_add(attention_out, None, x)
        mlp_out, mlp_bias = self.mlp(kernels.norm(self.post_attention_norm, x, self.kernels))
        return self._dropout_add(mlp_out, mlp_bias, x)

    def _dropout_add(self, y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
        return kernels.bias_dropout_add(
            y, bias, residual, self.hidden_dropout, self.hidden_dropout_p, self.training, self.kernels
        )


class Embedding(nn.Module):
    """Word (+ learned position) embeddings: token ids [b, s] -> hidden [s, b, h]."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, spec: RankSpec):
        super().__init__()
        # nn.Embedding, or under tensor parallelism a VocabParallelEmbedding (rows split by vocabulary)
        self.word_embeddings = spec.tp.layers.word_embedding(padded_vocab_size, cfg.hidden_size)
        mark_vocab_rows(cast(nn.Parameter, self.word_embeddings.weight), cfg)
        self.position_embeddings = (
            plain_embedding(cfg.max_positions, cfg.hidden_size) if cfg.position_embedding_type == "learned" else None
        )
        self.dropout = build_dropout(cfg.hidden_dropout, spec.dropout.hidden)
        self.scatter_to_sequence_parallel = spec.tp.scatter_to_sequence_parallel  # split along s under SP

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids)  # [b, s, h]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        x = self.scatter_to_sequence_parallel(x.transpose(0, 1).contiguous())  # [s(/tp), b, h]
        return self.dropout(x)


def mark_vocab_rows(weight: torch.Tensor, cfg: ModelConfig) -> None:
    """A vocabulary table [V_padded, h]: only the first cfg.vocab_size rows are real (the padding grows with
    tp, so checkpoints and exports hold the real rows only); the table's split, if any, is kept."""
    set_param_info(weight, sharding=replace(param_info(weight).sharding, valid_rows=cfg.vocab_size))


class GPTModel(nn.Module):
    """GPT decoder, or one pipeline chunk of it.

    Args:
        cfg: the model section.
        padded_vocab_size: rows of the embedding / output layer (see ModelConfig.padded_vocab_size).
        layer_ids: global indices of the layers this module holds (default: all).
        pre_process: holds the embedding (the first chunk of the first stage).
        post_process: holds final norm, output layer and loss (the last chunk of the last stage).
        spec: this rank's description: split layers and tp hooks, cp attention, dropout streams, recompute,
            kernels (default: `RankSpec.one_process(cfg)`).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        padded_vocab_size: int,
        layer_ids: Sequence[int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        spec: RankSpec | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        spec = spec or RankSpec.one_process(cfg)
        self.tp_hooks = spec.tp
        self.pre_process, self.post_process = pre_process, post_process
        layer_ids = list(range(cfg.num_layers) if layer_ids is None else layer_ids)
        self.embedding = Embedding(cfg, padded_vocab_size, spec) if pre_process else None
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, spec, i) for i in layer_ids})
        self.final_norm = build_norm(cfg, spec.tp) if post_process else None
        # nn.Linear, or under tensor parallelism a ColumnParallelLinear split by vocabulary (same weight attribute)
        self.output_layer = spec.tp.layers.output_layer(cfg.hidden_size, padded_vocab_size) if post_process else None
        if self.output_layer is not None:
            mark_vocab_rows(self.output_weight(), cfg)
            if cfg.tie_embeddings:
                self._tie_output_to_embedding()
        self._mark_split_tied_embedding()
        self.kernels = spec.kernels
        self.recompute_layer_ids = set(spec.recompute.layer_ids([int(i) for i in layer_ids]))
        self.checkpoint_fn: CheckpointFn | None = spec.recompute.checkpoint_fn

    def transformer_layers(self) -> list[tuple[int, TransformerLayer]]:
        """(global layer index, layer) of the layers this chunk holds, in order."""
        return [(int(layer_id), cast(TransformerLayer, layer)) for layer_id, layer in self.layers.items()]

    def moe_layers(self) -> list[tuple[int, MoELayer]]:
        """(global layer index, MoE layer) of the layers of this chunk that hold one, in order."""
        return [
            (layer_id, layer.mlp) for layer_id, layer in self.transformer_layers() if isinstance(layer.mlp, MoELayer)
        ]

    def word_embedding_weight(self) -> nn.Parameter:
        """The word embedding table [V(/tp), h] (the first chunk only)."""
        if self.embedding is None:
            raise RuntimeError("only the first pipeline chunk holds the word embeddings")
        return cast(nn.Parameter, self.embedding.word_embeddings.weight)

    def output_weight(self) -> nn.Parameter:
        """The output layer's weight [V(/tp), h] (the last chunk only)."""
        if self.output_layer is None:
            raise RuntimeError("only the last pipeline chunk holds the output layer")
        return cast(nn.Parameter, self.output_layer.weight)

    def _tie_output_to_embedding(self) -> None:
        if self.pre_process:
            cast(nn.Module, self.output_layer).weight = self.word_embedding_weight()
        else:
            # The last stage's own copy: initialised from the same seed as the embedding and kept equal
            # by all-reducing its gradient over the embedding group. `embedding_copy` marks the copy so
            # that the gradient norm counts the tied weight once.
            set_param_info(
                self.output_weight(),
                init_name="embedding.word_embeddings.weight",
                shared_embedding=True,
                embedding_copy=True,
            )

    def _mark_split_tied_embedding(self) -> None:
        if self.cfg.tie_embeddings and self.pre_process and not self.post_process:
            set_param_info(self.word_embedding_weight(), shared_embedding=True)

    def _num_valid_vocab(self) -> int:
        """Columns of this rank's logits that are real vocabulary: padded rows (which grow with tp) never
        score, so every tp size trains the same model and the padding rows get no gradient."""
        return cast(int, self.cfg.vocab_size) - self._vocab_start_index()

    def _vocab_start_index(self) -> int:
        """First vocabulary id of this rank's logits [s, b, V(/tp)]: where its output-layer shard starts."""
        # from the hooks, not the weight: under FSDP the forward sees the gathered weight, a new tensor
        return self.tp_hooks.tp_rank * self.output_weight().shape[0]

    def compile_layers(self, backend: str) -> None:
        """Regional compilation: torch.compile each transformer layer in place (parameter names unchanged).
        The layers share their code, so compile time stays flat in the number of layers. Selective recompute's
        checkpoint (inside the layer) runs eagerly: its context_fn swaps RNG-tracker states, which dynamo cannot
        trace; full recompute checkpoints whole compiled layers from outside and needs nothing."""
        for _, layer in self.transformer_layers():
            if layer.attention.recompute_core and layer.attention.checkpoint_fn is not None:
                layer.attention.checkpoint_fn = torch.compiler.disable(layer.attention.checkpoint_fn)
            layer.compile(backend=backend)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Embedding (first chunk) or hidden_states [s, b, h] in; hidden [s, b, h] out, or on the last chunk
        per-token loss [b, s] when labels [b, s] are given, else logits [b, s, V(/tp)]. With `kv_cache`
        (generation) the tokens continue the cached ones: position_ids start at kv_cache.length."""
        if self.embedding is not None:
            x = self.embedding(input_ids, position_ids)
        elif hidden_states is not None:
            x = hidden_states
        else:
            raise ValueError("a chunk without the embedding needs hidden_states")
        rotary = None
        if self.cfg.position_embedding_type == "rope":
            if position_ids is None:
                raise ValueError("rotary positions need position_ids")
            rotary = rotary_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rotary_base, x.dtype)
        for layer_id, layer in self.transformer_layers():
            if layer_id in self.recompute_layer_ids and self.training and self.checkpoint_fn is not None:
                x = self.checkpoint_fn(layer, x, rotary, attention_mask)
            else:
                x = layer(x, rotary, attention_mask, None if kv_cache is None else kv_cache.layer(layer_id))
        if self.final_norm is None or self.output_layer is None:
            return x
        x = kernels.norm(self.final_norm, x, self.kernels)
        hooks = self.tp_hooks
        if labels is not None and self.kernels.uses("linear_cross_entropy"):
            return kernels.fused_linear_cross_entropy(
                hooks.head_input(x),
                self.output_weight(),
                labels.t(),
                self._vocab_start_index(),
                self._num_valid_vocab(),
                hooks.loss_reductions,
            ).t()  # [b, s]
        logits = mask_vocab_padding(self.output_layer(x), self._num_valid_vocab())  # [s, b, V(/tp)]
        if labels is None:
            return logits.transpose(0, 1)
        return hooks.loss_fn(logits, labels.t()).t()  # [b, s]
