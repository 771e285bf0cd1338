"""Mixture of Experts in the planner: active FLOPs, the experts' placement over ep, their state per rank, the
all-to-all of expert parallelism and the expert-data-parallel gradient reduction.

Semantics are megatron-core's (expert tensor parallel size 1), as model/moe/ and parallel/expert_parallel.py run
them. Expert parallelism re-divides the dp x cp ranks of a layout: for the experts the world is (tp, ep,
expert_dp, pp) with ep x expert_dp = dp x cp (`expert_grid`: tp fastest, then ep, then expert_dp, then pp), and

- each ep rank holds num_experts / ep whole experts, replicated over its tp ranks and over the expert_dp group;
  the router and the shared expert are replicated like every other replicated weight (over tp, reduced over
  dp x cp);
- with sequence parallelism each tp rank routes its own s/tp tokens; without it the tp ranks route the same
  tokens (the experts' work is then repeated on every tp rank, not split);
- the dispatcher (model/moe/dispatch.py) sends per MoE layer and micro-batch, over the ep group, the token
  counts ([E] int64), the permuted tokens [P, h] and their fp32 routing weights [P], and brings the experts'
  outputs [P, h] back (P = routed tokens x top_k). Backward sends the outputs' gradients out and the tokens' and
  weights' gradients back; the counts have none.

FLOPs count what a token computes (its top_k routed experts, the router, the shared expert), as model/shape.py
counts a dense layer: 2 x multiply-adds, backward = 2 x forward, attention over the full s x s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from model.config import ModelConfig
from model.rank_spec import Recompute
from model.shape import IterationFlops, ParamShape, attention_matmul_flops, layer_gemms, output_gemm
from parallel.layout import Layout, LayoutError
from parallel.rank_grid import RankGrid

if TYPE_CHECKING:
    from config.schema import Config

EXPERT_ORDER = ("tp", "ep", "expert_dp", "pp")  # the experts' view of the ranks, fastest-varying first
COUNT_BYTES = 8  # the dispatcher's token counts are int64
PROB_BYTES = 4  # routing weights stay fp32 (the router computes in fp32 whatever the precision)


def ep_size_of(config: Config) -> int:
    """The config's expert-parallel size: `parallel.ep_size`, 1 where the config has no such key (a schema
    from before expert parallelism) or no experts."""
    return int(getattr(config.parallel, "ep_size", 1)) if config.model.num_experts else 1


@dataclass(frozen=True)
class ExpertLayout:
    """Where the experts of a layout sit: `ep_size` ranks share each MoE layer's `num_experts`, replicated over
    `expert_dp_size` = dp x cp / ep ranks; `sequence_parallel` and `tp_size` say whose tokens each rank routes."""

    num_experts: int
    ep_size: int
    expert_dp_size: int
    tp_size: int
    sequence_parallel: bool

    @classmethod
    def of(cls, model: ModelConfig, layout: Layout, ep_size: int) -> ExpertLayout:
        """The experts' placement under `layout` with `ep_size` (LayoutError naming the keys if it cannot be)."""
        experts = model.num_experts or 0
        dp_cp = layout.dp_size * layout.cp_size
        if ep_size < 1:
            raise LayoutError(f"parallel.ep_size={ep_size} must be >= 1")
        if ep_size > 1 and not experts:
            raise LayoutError(f"parallel.ep_size={ep_size} needs an MoE model: model.num_experts={model.num_experts}")
        if dp_cp % ep_size:
            raise LayoutError(f"parallel.ep_size={ep_size} does not divide dp x cp = {dp_cp}")
        if experts and experts % ep_size:
            raise LayoutError(f"model.num_experts={experts} is not divisible by parallel.ep_size={ep_size}")
        sp = layout.sequence_parallel and layout.tp_size > 1
        return cls(experts, ep_size, dp_cp // ep_size, layout.tp_size, sp)

    @property
    def local_experts(self) -> int:
        """Experts of each MoE layer on one rank: E / ep."""
        return self.num_experts // self.ep_size

    def routed_tokens(self, local_tokens: float) -> float:
        """Tokens one rank routes from a micro-batch's `local_tokens` (s/cp x b): 1/tp of them with sequence
        parallelism, all of them otherwise."""
        return local_tokens / self.tp_size if self.sequence_parallel else local_tokens


def expert_grid(layout: Layout, ep_size: int) -> RankGrid:
    """The experts' rank grid of `layout` (EXPERT_ORDER): an ep group is ep consecutive members of a dp x cp
    group (stride tp), an expert-dp group strides by tp x ep."""
    dp_cp = layout.dp_size * layout.cp_size
    sizes = {"tp": layout.tp_size, "ep": ep_size, "expert_dp": dp_cp // ep_size, "pp": layout.pp_size}
    return RankGrid(tuple((name, sizes[name]) for name in EXPERT_ORDER))


def moe_layer_ids(model: ModelConfig) -> list[int]:
    """The layers that hold an MoE layer in place of the dense MLP."""
    return [layer for layer in range(model.num_layers) if model.is_moe_layer(layer)]


# ---- FLOPs ---------------------------------------------------------------------------------------------
def expert_mlp_weights(model: ModelConfig, ffn: int) -> int:
    """Multiply-adds per token of one MLP of width `ffn` (fc1 [h -> ffn, x2 gated], fc2 [ffn -> h])."""
    stacked = 2 if model.activation == "swiglu" else 1
    return model.hidden_size * ffn * stacked + ffn * model.hidden_size


def moe_mlp_weights(model: ModelConfig) -> int:
    """Multiply-adds per token of an MoE layer's MLP part: the router [h -> E], top_k routed experts, the
    shared expert and its gate [h -> 1]."""
    h, experts = model.hidden_size, model.num_experts or 0
    shared = model.moe_shared_expert_ffn_hidden_size or 0
    total = h * experts + model.moe_router_topk * expert_mlp_weights(model, model.moe_ffn_size)
    if shared:
        total += expert_mlp_weights(model, shared) + (h if model.moe_shared_expert_gate else 0)
    return total


def layer_forward_flops(model: ModelConfig, layer: int, tokens: float) -> float:
    """Forward FLOPs of layer `layer` over `tokens` tokens: attention's qkv and proj GEMMs and its two batched
    matmuls, then the dense MLP or the MoE layer's active part."""
    qkv, proj, fc1, fc2 = layer_gemms(model)
    mlp = moe_mlp_weights(model) if model.is_moe_layer(layer) else fc1.weights + fc2.weights
    attention = 2 * attention_matmul_flops(model, tokens, model.seq_length)
    return 2.0 * tokens * (qkv.weights + proj.weights + mlp) + attention


def iteration_flops(
    model: ModelConfig, padded_vocab: int, global_batch_size: int, recompute: Recompute, num_chunks: int
) -> IterationFlops:
    """Training FLOPs of one iteration counted from active parameters (model/shape.iteration_flops' rules:
    3 x forward; full recomputation repeats the forward of the layers each of the `num_chunks` equal chunks
    checkpoints, selective the two attention matmuls of every layer)."""
    tokens = float(global_batch_size * model.seq_length)
    layers = [layer_forward_flops(model, layer, tokens) for layer in range(model.num_layers)]
    forward = sum(layers) + 2.0 * tokens * output_gemm(model, padded_vocab).weights
    if recompute.mode == "selective":
        recomputed = model.num_layers * 2 * attention_matmul_flops(model, tokens, model.seq_length)
    else:
        per_chunk = model.num_layers // num_chunks
        recomputed = sum(
            layers[layer]
            for first in range(0, per_chunk * num_chunks, per_chunk)
            for layer in recompute.layer_ids(range(first, first + per_chunk))
        )
    return IterationFlops(model=3.0 * forward, with_recompute=3.0 * forward + recomputed)


# ---- parameters ----------------------------------------------------------------------------------------
def expert_params(model: ModelConfig) -> int:
    """Parameters of one routed expert: fc1 and fc2 weights and, with biases, theirs."""
    ffn, h = model.moe_ffn_size, model.hidden_size
    stacked = 2 if model.activation == "swiglu" else 1
    bias = ffn * stacked + h if model.add_bias_linear else 0
    return expert_mlp_weights(model, ffn) + bias


def replicated_moe_params(model: ModelConfig) -> int:
    """Parameters of an MoE layer outside its routed experts, replicated like dense weights over tp and dp x cp:
    the router (and its bias), the shared expert and its gate."""
    h, experts = model.hidden_size, model.num_experts or 0
    total = h * experts + (experts if model.add_bias_linear else 0)
    shared = model.moe_shared_expert_ffn_hidden_size or 0
    if shared:
        stacked = 2 if model.activation == "swiglu" else 1
        total += expert_mlp_weights(model, shared) + (shared * stacked + h if model.add_bias_linear else 0)
        total += h if model.moe_shared_expert_gate else 0
    return total


def dense_mlp_params(model: ModelConfig, tp_size: int) -> int:
    """Parameters of the dense MLP (fc1, fc2) on one tp rank: what an MoE layer holds in its place."""
    return sum(gemm.params(tp_size) for gemm in layer_gemms(model)[2:])


@dataclass(frozen=True)
class RankExpertParams:
    """Parameters of one pipeline rank's layers that an MoE model changes: `experts` (its ep rank's routed
    experts, replicated over expert_dp) and `replicated` (routers and shared experts, replicated over dp x cp),
    and `dense_mlp_removed`, the dense MLPs the MoE layers replace (model/shape.rank_params counts them)."""

    experts: int
    replicated: int
    dense_mlp_removed: int


def rank_expert_params(model: ModelConfig, experts: ExpertLayout, tp_size: int, layers: list[int]) -> RankExpertParams:
    """RankExpertParams of the pipeline rank holding global layers `layers`, on one (tp, ep) rank."""
    moe = [layer for layer in layers if model.is_moe_layer(layer)]
    return RankExpertParams(
        experts=len(moe) * experts.local_experts * expert_params(model),
        replicated=len(moe) * replicated_moe_params(model),
        dense_mlp_removed=len(moe) * dense_mlp_params(model, tp_size),
    )


def expert_state_bytes(
    params: RankExpertParams, precision: str, distributed_optimizer: bool, dp_cp_size: int, expert_dp_size: int
) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes an MoE model adds to a rank over the dense count (negative where the
    dense MLP it replaces was larger): per parameter the 16-bit (or fp32) weight, the fp32 main grad and Adam's
    state; the distributed optimizer shards the experts' state over expert_dp and the rest over dp x cp."""
    weights = 4.0 if precision == "fp32" else 2.0
    plain = 8.0 if precision == "fp32" else 12.0
    expert_opt = 12.0 / expert_dp_size if distributed_optimizer else plain
    dense_opt = 12.0 / dp_cp_size if distributed_optimizer else plain
    moved = params.experts + params.replicated - params.dense_mlp_removed
    replicated = params.replicated - params.dense_mlp_removed
    return weights * moved, 4.0 * moved, expert_opt * params.experts + dense_opt * replicated


# ---- activations -------------------------------------------------------------------------------------------
def moe_activation_delta(model: ModelConfig, experts: ExpertLayout, local_tokens: float, value_bytes: int) -> float:
    """Bytes an MoE layer keeps for backward per micro-batch beyond the dense MLP it replaces (planner/activations
    counts the dense one: its fc1 output and activation, [tokens, ffn] x (3 gated, 2 otherwise) / tp): the
    permuted tokens [P, h], each routed expert's fc1 output and activation [P, f] x (3 | 2), the routing weights,
    and the shared expert's like a dense MLP, on the tokens the rank routes."""
    routed = experts.routed_tokens(local_tokens)
    rows = routed * model.moe_router_topk  # P, balanced over the ep ranks: what arrives equals what leaves
    per_ffn = 3 if model.activation == "swiglu" else 2
    shared = model.moe_shared_expert_ffn_hidden_size or 0
    kept = value_bytes * (rows * model.hidden_size + rows * model.moe_ffn_size * per_ffn + routed * shared * per_ffn)
    kept += PROB_BYTES * rows
    dense = value_bytes * local_tokens * model.ffn_size * per_ffn / experts.tp_size
    return kept - dense


# ---- communication -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Exchange:
    """One all-to-all over the ep group: `kind` "all_to_all", its bytes leaving this rank's input buffer (the
    part addressed to itself included, as all_to_all_single's input is the whole buffer)."""

    what: str
    nbytes: float


def dispatch_exchanges(
    model: ModelConfig, experts: ExpertLayout, local_tokens: float, value_bytes: int, forward: bool
) -> list[Exchange]:
    """The all-to-alls of one MoE layer and micro-batch on one rank (module docstring), balanced routing: the
    rank sends P = routed tokens x top_k rows of h values and receives as many."""
    if experts.ep_size == 1:
        return []
    rows = experts.routed_tokens(local_tokens) * model.moe_router_topk
    tokens = rows * model.hidden_size * value_bytes
    if forward:
        return [
            Exchange("counts", COUNT_BYTES * experts.num_experts),
            Exchange("tokens", tokens),
            Exchange("probs", PROB_BYTES * rows),
            Exchange("outputs", tokens),
        ]
    return [
        Exchange("outputs_grad", tokens),
        Exchange("tokens_grad", tokens),
        Exchange("probs_grad", PROB_BYTES * rows),
    ]


def all_to_all_seconds(
    nbytes: float,
    group_size: int,
    per_node: int,
    nvlink_gbs: float,
    network_gbs: float,
    base_us: float,
    nvlink_latency_us: float,
    network_latency_us: float,
) -> float:
    """One all_to_all_single of an `nbytes` buffer over `group_size` ranks, `per_node` of them on each node: each
    rank keeps 1/n, sends (g - 1)/n over NVLink and (n - g)/n over its network card at once (NCCL's grouped
    sends to every peer), the slower link sets the time, plus one call and one hop of latency."""
    n = group_size
    if n <= 1 or nbytes <= 0:
        return 0.0
    g = max(1, min(per_node, n))
    intra = nbytes * (g - 1) / n / (nvlink_gbs * 1e9)
    inter = nbytes * (n - g) / n / (network_gbs * 1e9) if n > g else 0.0
    hop = network_latency_us if n > g else nvlink_latency_us
    return max(intra, inter) + (base_us + hop) * 1e-6


# ---- gradient buckets --------------------------------------------------------------------------------------
def moe_layer_parameters(
    model: ModelConfig, experts: ExpertLayout, layer: int, sp: bool
) -> list[tuple[ParamShape, bool]]:
    """(parameter, is an expert weight) of MoE layer `layer`'s MLP part on one (tp, ep) rank, in registration
    order (model/moe/layer.MoELayer: router, routed experts, shared expert). All are replicated over tp: under
    sequence parallelism each tp rank's gradient is partial (summed over tp after the pipeline). The experts
    count as expert weights only with ep > 1: at ep = 1 the trainer buckets them with the rest."""
    parallel = experts.ep_size > 1
    h, f, bias, experts_here = model.hidden_size, model.moe_ffn_size, model.add_bias_linear, experts.local_experts
    stacked = 2 if model.activation == "swiglu" else 1
    prefix = f"layers.{layer}.mlp"
    num_experts = experts.num_experts
    found = [(ParamShape(f"{prefix}.router.weight", num_experts * h, sequence_parallel=sp, rows=num_experts), False)]
    if bias:
        found.append((ParamShape(f"{prefix}.router.bias", num_experts, sequence_parallel=sp), False))
    grouped = [("fc1_weight", f * stacked * h), ("fc2_weight", h * f)]
    grouped += [("fc1_bias", f * stacked), ("fc2_bias", h)] if bias else []
    for name, per_expert in grouped:
        shape = ParamShape(
            f"{prefix}.experts.{name}", experts_here * per_expert, sequence_parallel=sp, rows=experts_here
        )
        found.append((shape, parallel))
    shared = model.moe_shared_expert_ffn_hidden_size or 0
    if shared:
        tensors = [("fc1.weight", shared * stacked * h, shared * stacked)]
        tensors += [("fc1.bias", shared * stacked, 0)] if bias else []
        tensors += [("fc2.weight", h * shared, h)]
        tensors += [("fc2.bias", h, 0)] if bias else []
        tensors += [("gate_weight", h, 1)] if model.moe_shared_expert_gate else []
        for name, numel, rows in tensors:
            found.append((ParamShape(f"{prefix}.shared_experts.{name}", numel, sequence_parallel=sp, rows=rows), False))
    return found


def with_moe_parameters(
    model: ModelConfig, experts: ExpertLayout, params: list[ParamShape]
) -> list[tuple[ParamShape, bool]]:
    """A chunk's parameters (model/shape.chunk_parameters, which lists every layer's dense MLP) with each MoE
    layer's fc1 and fc2 replaced by its router, experts and shared expert: (parameter, is an expert weight)."""
    found: list[tuple[ParamShape, bool]] = []
    for param in params:
        parts = param.name.split(".")
        in_mlp = len(parts) > 3 and parts[0] == "layers" and parts[2] == "mlp"
        if not in_mlp or not model.is_moe_layer(int(parts[1])):
            found.append((param, False))
        elif parts[3] == "fc1" and parts[4] == "weight":  # the first of the dense MLP's tensors: the MoE in its place
            found += moe_layer_parameters(model, experts, int(parts[1]), experts.sequence_parallel)
    return found
