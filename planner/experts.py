"""Mixture of Experts in the planner: the experts' placement over ep, the activations an MoE layer keeps, the
all-to-all of expert parallelism and which gradients the expert-data-parallel group reduces.

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

What the model is (its FLOPs per token, its parameters, the E / ep experts' parameters of an ep rank) is
model/shape.py's count, the one the trainer and the tools read too; this module adds only where those
parameters sit and what moving tokens and gradients between them costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from model.config import ModelConfig
from model.shape import ParamShape
from parallel.layout import Layout, LayoutError
from parallel.rank_grid import RankGrid

if TYPE_CHECKING:
    from config.schema import Config

EXPERT_ORDER = ("tp", "ep", "expert_dp", "pp")  # the experts' view of the ranks, fastest-varying first
COUNT_BYTES = 8  # the dispatcher's token counts are int64
PROB_BYTES = 4  # routing weights stay fp32 (the router computes in fp32 whatever the precision)


def ep_size_of(config: Config) -> int:
    """The config's expert-parallel size: `parallel.ep_size`, 1 for a model without experts."""
    return config.parallel.ep_size if config.model.num_experts else 1


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

    def reduced_apart(self, param: ParamShape) -> bool:
        """Whether `param`'s gradient is reduced (and sharded) over the expert-dp group apart from the rest: a
        routed expert weight (ParamShape.expert) at ep > 1; at ep = 1 the trainer buckets the experts with
        everything else (parallel/data_parallel.py: ParamInfo.experts is set only under expert parallelism)."""
        return param.expert and self.ep_size > 1

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
