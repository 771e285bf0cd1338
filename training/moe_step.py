"""What a training step does for the Mixture-of-Experts layers of this rank's chunks (model/moe/layer.py),
besides their forward and backward: the auxiliary losses' gradient scale before the micro-batches run, the
aux-loss-free expert bias step after the optimizer's, and the step's routing metrics for the logs.

Every function here is called on every rank, MoE layers or not, so that the collectives match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from model.gpt import GPTModel
from model.moe.layer import MoELayer, RouterStats
from model.param_info import param_info
from parallel.grad_utils import all_reduce_coalesced
from parallel.state import ParallelState

# The metrics' columns after the E expert loads, per layer (see `step_metrics`).
_LOSS_NAMES = ("load_balancing_loss", "z_loss")


def set_aux_loss_scale(chunks: Sequence[GPTModel], scale: float) -> None:
    """Give every MoE layer the factor of its auxiliary losses' gradients: what the executor scales each
    micro-batch's language-model loss by (1 / micro-batches, x the loss scale), so the auxiliary losses reach
    the gradients as they would in one process's sum over its micro-batches."""
    for chunk in chunks:
        for _, moe in chunk.moe_layers():
            moe.aux_loss_backward_scale = scale


def _replicated_over_tp(moe: MoELayer, state: ParallelState) -> bool:
    """Whether every tp rank routed the same tokens (tp without sequence parallelism: the router's gradient is
    not partial, model/gpt.build_moe_layer) and so holds a copy of the same statistics."""
    return state.tp_size > 1 and not param_info(moe.router.weight).sequence_parallel


@torch.no_grad()
def update_expert_biases(chunks: Sequence[GPTModel], state: ParallelState) -> None:
    """The aux-loss-free balancing step of every router with an expert bias, after the optimizer step, from
    the selections counted over the global batch: summed over dp x cp, and over tp under sequence parallelism
    (megatron-core sums over tp x dp x cp; without sequence parallelism the tp ranks hold copies, which would
    scale every count alike and leave the step, a sign, unchanged). Each pipeline stage steps its own layers."""
    biased = [moe for chunk in chunks for _, moe in chunk.moe_layers() if moe.router.tokens_per_expert is not None]
    if not biased:
        return
    counts = [cast(torch.Tensor, moe.router.tokens_per_expert) for moe in biased]
    if state.dp_cp_group is not None:
        all_reduce_coalesced(counts, state.comm, state.dp_cp_group)
    if state.tp_size > 1 and not _replicated_over_tp(biased[0], state):
        all_reduce_coalesced(counts, state.comm, state.tp_group)
    for moe in biased:
        moe.router.update_expert_bias()


def step_metrics(
    chunks: Sequence[GPTModel], state: ParallelState, num_layers: int, num_experts: int
) -> dict[str, float]:
    """The step's routing metrics over the global batch, the same on every rank (one all-reduce over the
    world; {} for a dense model): `moe_load_balancing_loss` and `moe_z_loss`, the losses (coefficients applied)
    averaged over micro-batches and over the MoE layers as the lm loss is averaged (a micro-batch's parts summed
    over its token group, the mean over dp); `moe_max_load` the busiest expert's assignments over the mean
    expert's, the largest over the layers; `moe_dropped_fraction` of all assignments, the ones capacity dropped.
    """
    if not num_experts:
        return {}
    width = num_experts + 2 + len(_LOSS_NAMES)  # [loads..., dropped, assigned, losses...]
    table = torch.zeros(num_layers, width, dtype=torch.float64)
    held = torch.zeros(num_layers, dtype=torch.float64)
    for chunk in chunks:
        for layer_id, moe in chunk.moe_layers():
            stats = moe.router.take_step_stats()
            copies = state.tp_size if _replicated_over_tp(moe, state) else 1
            table[layer_id] = _layer_row(stats, num_experts, copies, state.dp_size)
            held[layer_id] = 1.0  # > 0 after the sum: some rank holds layer `layer_id`
    merged = torch.cat([table.reshape(-1), held])
    if state.is_distributed:
        state.comm.all_reduce(merged, None)
    table, held = merged[:-num_layers].reshape(num_layers, width), merged[-num_layers:]
    moe_rows = table[held > 0]
    if not len(moe_rows):
        return {}
    loads = moe_rows[:, :num_experts]
    max_load = (loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1e-12)).max()
    metrics = {
        "moe_max_load": float(max_load),
        "moe_dropped_fraction": float(moe_rows[:, num_experts].sum() / moe_rows[:, num_experts + 1].sum().clamp(min=1)),
    }
    for column, name in enumerate(_LOSS_NAMES, start=num_experts + 2):
        metrics[f"moe_{name}"] = float(moe_rows[:, column].mean())
    return metrics


def _layer_row(stats: RouterStats, num_experts: int, copies: int, dp_size: int) -> torch.Tensor:
    """One layer's part of the metrics table from this rank: counts / copies (tp ranks holding the same
    tokens), losses / (micro-batches x copies x dp), so the world's sum is the global figure."""
    row = torch.zeros(num_experts + 2 + len(_LOSS_NAMES), dtype=torch.float64)
    if stats.expert_load is not None and stats.dropped is not None:
        row[:num_experts] = stats.expert_load.double().cpu() / copies
        row[num_experts] = float(stats.dropped) / copies
        row[num_experts + 1] = stats.assigned / copies
    for column, name in enumerate(_LOSS_NAMES, start=num_experts + 2):
        value = stats.losses.get(name)
        if value is not None:
            row[column] = float(value) / (max(stats.microbatches, 1) * copies * dp_size)
    return row
