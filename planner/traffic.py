"""Inter-node traffic of one layout (the paper's §5.9) and the size and save/load time of its checkpoint (§5.10).

§5.9 reports, for the 1T model on 3072 GPUs, an "effective bisection bandwidth" of 892 GB/s for the pipeline's
point-to-point messages and 12.9 TB/s for the data-parallel all-reduce, without a derivation. Here the bandwidth
is the paper's sense as the planner reads it: the bytes the layout moves between nodes per iteration, summed
over all GPUs, over the predicted iteration time. Pipeline: each micro-batch's activation crosses every
boundary between consecutive virtual stages forward and its gradient backward; each GPU sends its own message
(1/tp of it with scatter/gather), and a boundary counts for the GPUs whose peer sits on another node. Data
parallel: each bucket of the gradient reduction as NCCL's ring moves it: a GPU sends factor (n - 1) / n of the
bucket (factor 2 for an all-reduce) and, with g of the group's members on its node, 1/g of that leaves the node
(costs.Hardware.collective_seconds prices the same bytes). The reduction's bytes are also reported over its own
predicted duration (`dp_allreduce_busy_bandwidth_gbps`): the rate while it runs.

Checkpoint: what the trainer writes per (tp, pp) rank, summed over ranks (data-parallel replicas write no
copy; the distributed optimizer splits the same bytes over dp): the 16-bit weights and the fp32 masters and two
Adam moments (2 + 4 + 8 bytes per parameter; fp32 runs keep no separate master: 4 + 8), the layer norms held on
every tp rank and a tied embedding's second copy on the last stage included, as each rank saves its own. Save and
load time: that size at the cluster's `storage` bandwidths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from model.shape import rank_params, routed_expert_params, total_params
from planner.costs import GROUP_DIMS, Hardware, collective_seconds_of
from planner.memory import rank_layer_ids

if TYPE_CHECKING:
    from config.schema import Config
    from planner.collectives import LayoutCollectives

MASTER_BYTES = 4.0  # fp32 master weights (16-bit runs)
MOMENT_BYTES = 8.0  # AdamW's two fp32 moments


@dataclass(frozen=True)
class Traffic:
    """Inter-node bytes of one iteration, summed over all GPUs, and the times they are spread over."""

    p2p_bytes: float  # pipeline activations and gradients crossing node boundaries
    dp_bytes: float  # the gradient reduction's bytes leaving nodes
    dp_seconds: float  # the reduction's own predicted duration (slowest pipeline rank, overlap not deducted)
    iteration_seconds: float

    @property
    def p2p_bandwidth_gbps(self) -> float:
        return self.p2p_bytes / self.iteration_seconds / 1e9

    @property
    def dp_allreduce_bandwidth_gbps(self) -> float:
        return self.dp_bytes / self.iteration_seconds / 1e9

    @property
    def dp_allreduce_busy_bandwidth_gbps(self) -> float:
        return self.dp_bytes / self.dp_seconds / 1e9 if self.dp_seconds > 0 else 0.0


def _stage_ranks(comms: LayoutCollectives) -> list[int]:
    """The pipeline rank of each virtual stage, in the order a micro-batch's activation visits them."""
    stages = comms.run.stages
    return [stages.stage_rank(stage) for stage in range(stages.num_stages)]


def pipeline_bytes(comms: LayoutCollectives, hw: Hardware) -> float:
    """Bytes per iteration that cross node boundaries between pipeline stages (all GPUs, both directions)."""
    lay, grid = comms.layout, hw.grid
    # one GPU's share of one message (the same split as LayoutCollectives.step)
    per_gpu = (comms.message_numel // lay.tp_size if comms.scatter else comms.message_numel) * comms.value_bytes
    stride, gpus_per_node = grid.stride("pp"), hw.cluster.gpus_per_node
    at_pp: dict[int, list[int]] = {}
    for rank in range(grid.world_size):
        at_pp.setdefault(grid.coord(rank, "pp"), []).append(rank)
    ranks = _stage_ranks(comms)
    crossing = 0
    for sender, receiver in zip(ranks, ranks[1:]):
        if sender == receiver:  # zb-v's turn: both chunks on one rank
            continue
        shift = (receiver - sender) * stride
        crossing += sum(1 for r in at_pp[sender] if r // gpus_per_node != (r + shift) // gpus_per_node)
    return 2.0 * crossing * per_gpu * lay.num_microbatches  # activation forward, its gradient backward


def reduction_bytes(comms: LayoutCollectives, hw: Hardware) -> tuple[float, float]:
    """(bytes leaving nodes, seconds of the slowest pipeline rank) of the data-parallel gradient reduction."""
    lay = comms.layout
    gpus_per_pp_rank = lay.world_size // lay.pp_size
    total, slowest = 0.0, 0.0
    for pp_rank in range(lay.pp_size):
        buckets = comms.grad_reduction(pp_rank)
        slowest = max(slowest, sum(collective_seconds_of(hw, c) for c in buckets))
        for c in buckets:
            n, g = c.group_size, max(1, min(hw.per_node(*GROUP_DIMS[c.group]), c.group_size))
            if n // g > 1:  # the ring spans nodes
                factor = 2.0 if c.kind == "all_reduce" else 1.0
                total += gpus_per_pp_rank * factor * (n - 1) / n * c.nbytes / g
    return total, slowest


def layout_traffic(comms: LayoutCollectives, hw: Hardware, iteration_seconds: float) -> Traffic:
    """The layout's inter-node traffic per iteration at the predicted iteration time."""
    dp_bytes, dp_seconds = reduction_bytes(comms, hw)
    return Traffic(pipeline_bytes(comms, hw), dp_bytes, dp_seconds, iteration_seconds)


def checkpoint_bytes_per_param(precision: str) -> float:
    """Bytes a checkpoint holds per parameter: the run's weights, fp32 masters (16-bit runs), two moments."""
    return (4.0 if precision == "fp32" else 2.0 + MASTER_BYTES) + MOMENT_BYTES


def checkpoint_bytes(config: Config, comms: LayoutCollectives) -> float:
    """The checkpoint's size: every (tp, pp) rank's parameters (FSDP: the model once) at the bytes above, an
    MoE model's routed experts once each."""
    lay, model = comms.layout, config.model
    per_param = checkpoint_bytes_per_param(config.train.precision)
    if comms.sharded is not None:
        return per_param * total_params(model)
    params = experts = 0
    for r in range(lay.pp_size):  # every routed expert of the rank's layers (ep = 1: all E)
        layers = rank_layer_ids(comms.run, r)
        params += rank_params(model, lay.tp_size, lay.pp_size, comms.run.chunk_roles(r), layer_ids=layers)
        experts += routed_expert_params(model, layers)
    # what every tp rank saves of its own, and the routed experts (whole on every tp rank) once
    return per_param * (lay.tp_size * (params - experts) + experts)
