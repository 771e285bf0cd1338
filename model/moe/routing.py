"""The router's arithmetic as megatron-core 0.16.1 computes it (megatron/core/transformer/moe/moe_utils.py):
top-k selection with a score function, the load-balancing losses, the z-loss, token dropping by capacity and
the aux-loss-free expert bias update. Pure functions of tensors, one process: the reductions over tp x cp or
tp x dp x cp that megatron-core runs inside them are the caller's (a rank's token counts are summed before
they are passed in), which keeps model/ free of torch.distributed.

Shapes: T tokens (s x b flattened, sequence first), E experts, k = top_k.
"""

from __future__ import annotations

import math

import torch


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    pre_softmax: bool,
    scaling_factor: float | None,
    expert_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing probs [T, E] with zeros off the selection, routing map [T, E] bool) from logits [T, E].

    softmax, pre_softmax=False: softmax over the k largest logits (Mixtral; equal to top-k of the softmax
    renormalised). softmax, pre_softmax=True: the k largest of the softmax over all experts, not renormalised
    (OLMoE, Qwen2-MoE with norm_topk_prob=false). sigmoid: the k largest sigmoid scores renormalised when k > 1
    (DeepSeek-V3); `expert_bias` [E] is added to the scores for the selection only, the weights come from the
    unbiased scores. `scaling_factor` multiplies the weights (DeepSeek-V3's routed_scaling_factor).
    """
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, top_indices = torch.topk(scores, k=topk, dim=1)
        else:
            top_logits, top_indices = torch.topk(logits, k=topk, dim=1)
            probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, top_indices = torch.topk(scores + expert_bias, k=topk, dim=1)
            top_scores = torch.gather(scores, dim=1, index=top_indices).type_as(logits)
        else:
            top_scores, top_indices = torch.topk(scores, k=topk, dim=1)
        probs = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else top_scores
    else:
        raise ValueError(f"model.moe_router_score_function={score_function!r} is not one of softmax, sigmoid")
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, top_indices, 1).bool()
    return routing_probs, routing_map


def scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing map [T, E] bool, scores [T, E]) the load-balancing losses see: the softmax (or the sigmoid
    normalised per token) over all experts and its top-k, with no expert bias and no dropping."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, top_indices = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, top_indices, 1).bool()
    return routing_map, scores


def switch_load_balancing_loss(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    topk: int,
    num_experts: int,
    coeff: float,
) -> torch.Tensor:
    """The Switch Transformer's auxiliary loss, coeff x E x sum_i f_i P_i with f_i the fraction of the T x k
    assignments that went to expert i and P_i the mean score of expert i: scores [T, E] (this rank's tokens),
    tokens_per_expert [E] (counted over all total_num_tokens tokens)."""
    aggregated_scores = scores.sum(dim=0)
    return torch.sum(aggregated_scores * tokens_per_expert) * (
        num_experts * coeff / (topk * total_num_tokens * total_num_tokens)
    )


def sequence_load_balancing_loss(
    scores: torch.Tensor,
    routing_map: torch.Tensor,
    seq_length: int,
    batch_size: int,
    topk: int,
    num_experts: int,
    coeff: float,
) -> torch.Tensor:
    """The sequence-level auxiliary loss (DeepSeek-V2/V3): the Switch loss of each sequence, averaged over the
    batch. megatron-core's trick: tokens [s x b] viewed as [s, b x E], so each sequence's experts are columns of
    their own and one Switch loss over s tokens and b x k picks sums the per-sequence losses."""
    scores = scores.reshape(seq_length, -1)  # [s, b x E]
    tokens_per_expert = routing_map.reshape(seq_length, -1).sum(dim=0)
    loss = switch_load_balancing_loss(scores, tokens_per_expert, seq_length, topk, num_experts, coeff)
    return loss / batch_size


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """The router z-loss (ST-MoE): coeff x mean over tokens of logsumexp(logits)^2; keeps the logits small."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens each expert takes: ceil(num_tokens / E x capacity_factor), num_tokens counting every one of the
    T x k assignments (megatron-core's get_capacity)."""
    return math.ceil((num_tokens / num_experts) * capacity_factor)


def drop_tokens(
    routing_probs: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    capacity_factor: float,
    drop_policy: str,
    pad_to_capacity: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E], map [T, E]) with at most `expert_capacity(T x k, E, factor)` tokens per expert.

    drop_policy "probs" keeps each expert's highest-weighted tokens (megatron-core's rule), "position" its
    earliest ones in token order. With `pad_to_capacity` every expert gets exactly that many rows (the kept tokens then, by
    position or weight, tokens not routed to it, with weight 0), so expert inputs have a fixed shape."""
    num_tokens, num_experts = routing_probs.shape
    capacity = expert_capacity(num_tokens * topk, num_experts, capacity_factor)
    if capacity > num_tokens:  # every token fits: nothing to drop (and topk over T rows would fail)
        capacity_mask = torch.ones_like(routing_map)
    else:
        if drop_policy == "probs":
            ranked = routing_probs
        elif drop_policy == "position":
            # megatron-core ranks routing_map.int(): ties of ones, and torch.topk's pick among equal values is
            # not the earliest (CPU picked rows 3 and 6 of 0, 2, 3, 5, 6). Ranking routed tokens above the rest,
            # earlier above later, keeps what the policy names: each expert's first tokens, then (padding) the
            # first unrouted ones.
            position = torch.arange(num_tokens, 0, -1, device=routing_map.device).unsqueeze(1)  # [T, 1]
            ranked = routing_map * (num_tokens + 1) + position
        else:
            raise ValueError(f"model.moe_token_drop_policy={drop_policy!r} is not one of probs, position")
        _, capacity_indices = torch.topk(ranked, k=capacity, dim=0, sorted=False)
        capacity_mask = torch.zeros_like(routing_probs).scatter(0, capacity_indices, 1).bool()
    final_map = capacity_mask if pad_to_capacity else torch.logical_and(routing_map, capacity_mask)
    return routing_probs * final_map, final_map


def updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, update_rate: float) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free balancing step: each expert's bias moves by update_rate towards balance
    (+ for experts below the mean load, - above it); tokens_per_expert [E] counted over the global batch."""
    average_tokens = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return expert_bias + torch.sign(average_tokens - tokens_per_expert) * update_rate
