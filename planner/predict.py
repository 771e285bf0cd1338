"""Predict one layout: iteration time, TFLOP/s per GPU, memory per GPU and where the time goes.

The pipeline part is not a formula: every pipeline rank's action list from parallel.pipeline.schedules and the
executor's plan of message batches (p2p.plan_steps) run through parallel.pipeline.simulator with this layout's
costs: each action its compute and the collectives it issues, each batch its transfers (and, with
scatter/gather, the receiving side's all-gather), with the trainer's overlap_p2p_comm. So the bubble and the
communication stalls are those of the lists and the plan the trainer runs. After the pipeline: the
data-parallel gradient reduction (overlapped with the last backward of each chunk, as the trainer's buckets
are), the tied-embedding and sequence-parallel reductions, the optimizer step and, with the distributed
optimizer, the parameter all-gathers. Every collective charged is one of planner/collectives.py's list for the
layout (tests/planner/test_collectives.py: the list equals what the trainer issues).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from model.shape import rank_params, routed_expert_params
from parallel.layout import Layout, LayoutError, build_layout
from parallel.pipeline.p2p import Step, produced_message
from parallel.pipeline.schedules import Action, Op, unhandled_op
from parallel.pipeline.simulator import CommPlan, Event, Timeline, simulate
from parallel.rank_grid import RankGrid
from planner.activations import ActivationShape, shape_from_config
from planner.cluster import ClusterSpec
from planner.collectives import Collective, LayoutCollectives
from planner.costs import (
    Hardware,
    action_comm_seconds,
    collective_seconds_of,
    head_times,
    layer_times,
    moe_layer_times,
    optimizer_seconds,
    step_seconds,
)
from planner.experts import ep_size_of, expert_grid
from planner.memory import GIB, MemoryEstimate, config_memory, rank_layer_ids
from planner.sharded import sharded_times
from planner.software import TRAINER, Software
from planner.traffic import Traffic, checkpoint_bytes, layout_traffic

if TYPE_CHECKING:
    from config.schema import Config

BREAKDOWN_KEYS = ("compute", "bubble", "tp_comm", "ep_comm", "pp_comm", "dp_comm", "optimizer")


@dataclass(frozen=True)
class ActionCost:
    """Seconds of one action on one rank, by kind; `pp_comm` is the synchronous send of its output where the
    software sends that way (Software.planned_p2p false), else 0 (the plan's batches carry the messages)."""

    compute: float
    tp_comm: float
    pp_comm: float = 0.0
    dp_comm: float = 0.0  # ZeRO-3 / FSDP: the gathers and reductions around it not hidden by compute
    ep_comm: float = 0.0  # expert parallelism's all-to-alls (nothing overlaps them)

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.pp_comm + self.dp_comm + self.ep_comm


@dataclass
class Prediction:
    """The planner's answer for one layout."""

    layout: Layout
    micro_batch_size: int
    recompute: str
    iteration_seconds: float
    flops_per_iteration: float
    breakdown: dict[str, float]  # seconds of the critical pipeline rank; sums to iteration_seconds
    recompute_seconds: float  # the part of "compute" spent re-running forwards
    memory: MemoryEstimate
    memory_capacity_gib: float
    bubble_fraction: float  # the simulated timeline's (makespan - busiest rank) / busiest rank
    traffic: Traffic  # inter-node bytes per iteration (§5.9, planner/traffic.py)
    checkpoint_bytes: float  # the checkpoint's size (§5.10)
    checkpoint_save_seconds: float | None  # at the cluster's storage bandwidth (None: the cluster gives none)
    checkpoint_load_seconds: float | None
    ep_size: int = 1  # expert parallelism (planner/experts.py): what the planner's layout adds to Layout

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops_per_iteration / self.iteration_seconds / self.layout.world_size / 1e12

    @property
    def memory_gib(self) -> float:
        return self.memory.total / GIB

    @property
    def fits(self) -> bool:
        return self.memory_gib <= self.memory_capacity_gib

    def describe_layout(self) -> str:
        lay = self.layout
        sp = " sp" if lay.sequence_parallel else ""
        fsdp = (" fsdp" + (f" x{lay.fsdp_replicate}" if lay.fsdp_replicate > 1 else "")) if lay.fsdp else ""
        ep = f" ep {self.ep_size}" if self.ep_size > 1 else ""
        return (
            f"tp {lay.tp_size} pp {lay.pp_size} vp {lay.vp_size} dp {lay.dp_size}{ep} mb {self.micro_batch_size} "
            f"recompute {self.recompute}{sp}{fsdp}"
        )

    def to_dict(self) -> dict[str, object]:
        lay = self.layout
        return {
            "layout": {
                "tp": lay.tp_size,
                "pp": lay.pp_size,
                "vp": lay.vp_size,
                "dp": lay.dp_size,
                "micro_batch_size": self.micro_batch_size,
                "num_microbatches": lay.num_microbatches,
                "schedule": lay.schedule,
                "sequence_parallel": lay.sequence_parallel,
                "recompute": self.recompute,
                "world_size": lay.world_size,
                "fsdp": lay.fsdp,
                "fsdp_replicate": lay.fsdp_replicate,
                "ep": self.ep_size,
            },
            "tflops_per_gpu": self.tflops_per_gpu,
            "iteration_seconds": self.iteration_seconds,
            "memory_gib_per_gpu": self.memory_gib,
            "fits": self.fits,
            "memory_capacity_gib": self.memory_capacity_gib,
            "breakdown_seconds": dict(self.breakdown),
            "recompute_seconds": self.recompute_seconds,
            "breakdown_fraction": {k: v / self.iteration_seconds for k, v in self.breakdown.items()},
            "bubble_fraction": self.bubble_fraction,
            "memory_breakdown_gib": self.memory.as_gib(),
            "memory_pp_rank": self.memory.pp_rank,
            "flops_per_iteration": self.flops_per_iteration,
            "p2p_bandwidth_GBps": self.traffic.p2p_bandwidth_gbps,
            "dp_allreduce_bandwidth_GBps": self.traffic.dp_allreduce_bandwidth_gbps,
            "dp_allreduce_busy_bandwidth_GBps": self.traffic.dp_allreduce_busy_bandwidth_gbps,
            "p2p_bytes_per_iteration": self.traffic.p2p_bytes,
            "dp_allreduce_bytes_per_iteration": self.traffic.dp_bytes,
            "dp_allreduce_seconds": self.traffic.dp_seconds,
            "checkpoint_TB": self.checkpoint_bytes / 1e12,
            "checkpoint_save_seconds": self.checkpoint_save_seconds,
            "checkpoint_load_seconds": self.checkpoint_load_seconds,
        }


class _Costs:
    """Per-action costs of one layout: compute per chunk and the collectives each action issues (listed by
    `comms`), and the seconds of each batch of pipeline messages."""

    def __init__(self, config: Config, layout: Layout, hw: Hardware, shape: ActivationShape, comms: LayoutCollectives):
        model, train = config.model, config.train
        self.layout, self.hw, self.comms, self.run = layout, hw, comms, comms.run
        per_chunk = self.run.stages.layers_per_chunk(model.num_layers)
        layer = self.layer = layer_times(shape, model, hw, train.recompute)
        # an MoE layer's times (planner/experts.py), per stage as many as the stage holds
        moe = layer if comms.experts is None else moe_layer_times(shape, model, hw, train.recompute, comms.experts)
        stage_layers = {c.virtual_stage: c.layer_ids for r in range(layout.pp_size) for c in self.run.chunks(r)}
        self.sharded = sharded_times(comms.sharded, self._sharded_seconds) if comms.sharded is not None else None
        self.recompute_per_chunk = per_chunk * layer.recompute
        self.block_seconds = layer.core / layout.cp_size  # one ring step's block attention
        head_f, head_b = head_times(shape, model, hw, self.run.padded_vocab)
        embed = hw.memory_seconds(3 * shape.local_seq * shape.micro_batch * shape.hidden * shape.value_bytes)
        last = self.run.stages.last_stage
        self.forward, self.backward, self.weight = {}, {}, {}
        for stage in range(self.run.stages.num_stages):
            moe_layers = sum(1 for i in stage_layers[stage] if model.is_moe_layer(i))
            dense_layers = per_chunk - moe_layers
            compute_f = dense_layers * layer.forward + moe_layers * moe.forward
            compute_b = dense_layers * layer.backward + moe_layers * moe.backward
            if stage == 0:
                compute_f, compute_b = compute_f + embed, compute_b + embed
            if stage == last:
                compute_f, compute_b = compute_f + head_f, compute_b + head_b
            self.forward[stage], self.backward[stage] = compute_f, compute_b
            # zero bubble's WEIGHT: the weight GEMMs; the first stage has no input gradient, so all of it
            weight = dense_layers * layer.weight_grad + moe_layers * moe.weight_grad
            self.weight[stage] = compute_b if stage == 0 else weight
        self._cache: dict[tuple[int, Op, int], ActionCost] = {}
        self._steps: dict[tuple[str, ...], float] = {}

    def of(self, pp_rank: int, action: Action) -> ActionCost:
        """The cost of `action` on pipeline rank `pp_rank` (the same for every micro-batch)."""
        key = (pp_rank, action.op, action.chunk)
        cost = self._cache.get(key)
        if cost is None:
            stage = self.run.stages.virtual_stage(pp_rank, action.chunk)
            match action.op:
                case Op.FORWARD:
                    compute = self.forward[stage]
                case Op.BACKWARD:
                    compute = self.backward[stage]
                case Op.BACKWARD_INPUT:
                    compute = self.backward[stage] - self.weight[stage]
                case Op.WEIGHT:
                    compute = self.weight[stage]
                case _:
                    unhandled_op(action.op)
            collectives = self.comms.action(stage, action.op)
            comm = action_comm_seconds(self.hw, collectives, self.block_seconds)
            ep_comm = self.seconds(list(collectives.ep))
            sent, sharded = self._send(pp_rank, action), self._sharded(action)
            cost = self._cache[key] = ActionCost(compute, comm, sent, sharded, ep_comm)
        return cost

    def _sharded_seconds(self, collective: Collective) -> float:
        """A sharded collective: priced at the software's share of the links, plus the HBM copies into and out of
        its flat buffer (read and write the gathered parameters, or the gradients)."""
        software, hw = self.comms.software, self.hw
        if software.sharded_bandwidth != 1.0:
            eff = hw.cluster.efficiency
            scaled = hw.cluster.with_efficiency(
                network=eff.network * software.sharded_bandwidth, nvlink=eff.nvlink * software.sharded_bandwidth
            )
            hw = Hardware(scaled, hw.fp32, hw.grid)
        copies = 2 * collective.nbytes if collective.kind in ("all_gather", "reduce_scatter") else 0
        return collective_seconds_of(hw, collective) + self.hw.memory_seconds(copies)

    def _sharded(self, action: Action) -> float:
        """ZeRO-3's exposed gathers and reductions around a forward or a backward (pp = 1: the whole model)."""
        if self.sharded is None:
            return 0.0
        match action.op:
            case Op.FORWARD:
                return self.sharded.forward_exposed(self.layer.forward)
            case Op.BACKWARD:
                return self.sharded.backward_exposed(self.layer.backward)
            case Op.BACKWARD_INPUT | Op.WEIGHT:  # zero bubble needs pp > 1, which FSDP refuses
                raise ValueError("a zero-bubble action under FSDP: the layout rules refuse pp > 1 with parallel.fsdp")
            case _:
                unhandled_op(action.op)

    def _send(self, pp_rank: int, action: Action) -> float:
        """Without the plan: the producer sends its output synchronously (transfer and, with scatter/gather,
        the receiver's all-gather), as Megatron-LM 2021 did."""
        if self.comms.software.planned_p2p:
            return 0.0
        out = produced_message(action, pp_rank, self.layout.pp_size, self.layout.vp_size, self.run.stages.v_shape)
        if out is None or out[0] == pp_rank:  # no message, or the local turn of zb-v's V
            return 0.0
        return step_seconds(self.hw, self.comms.step(Step((("send", out[0], out[1]), ("recv", pp_rank, out[1])), None)))

    def step(self, pp_rank: int, step: Step) -> float:
        """Seconds of one batch of pipeline messages on `pp_rank` (all messages are the same size: the batch's
        kinds decide)."""
        kinds = tuple(kind for kind, _, _ in step.ops)
        if kinds not in self._steps:
            self._steps[kinds] = step_seconds(self.hw, self.comms.step(step))
        return self._steps[kinds]

    def seconds(self, collectives: list[Collective]) -> float:
        return sum(collective_seconds_of(self.hw, c) for c in collectives)


def _dp_exposed(events: list[Event], dp_seconds: float, bucket_seconds: float) -> float:
    """Gradient reduction left after the rank's pipeline ends: buckets launch during the last backward of
    each chunk (the trainer enables grad sync there), and the last bucket can only start at the very end."""
    if dp_seconds <= 0:
        return 0.0
    last_backward: dict[int, float] = {}
    for event in events:
        match event.action.op:
            case Op.FORWARD | Op.BACKWARD_INPUT:
                pass
            case Op.BACKWARD | Op.WEIGHT:  # the last action making weight gradients
                last_backward[event.action.chunk] = event.start
            case _:
                unhandled_op(event.action.op)
    window = max(e.end for e in events) - min(last_backward.values())
    return max(min(bucket_seconds, dp_seconds), dp_seconds - window)


def memory_of(
    config: Config,
    layout: Layout,
    cluster: ClusterSpec,
    shape: ActivationShape,
    software: Software = TRAINER,
    ep_size: int = 1,
) -> MemoryEstimate:
    """The busiest rank's memory with the cluster's allowance and allocator overhead (experts over `ep_size`)."""
    allowance = cluster.memory_allowance_gib * GIB
    return config_memory(config, layout, shape, allowance, cluster.activation_overhead, software, ep_size)


def predict(
    config: Config, cluster: ClusterSpec, world_size: int, software: Software = TRAINER, ep_size: int | None = None
) -> Prediction:
    """Predict the layout `config` describes on `world_size` GPUs of `cluster` (LayoutError if invalid), as
    `software` runs it (default: this trainer), an MoE model's experts over `ep_size` ranks (None: the
    config's parallel.ep_size, planner/experts.ep_size_of)."""
    model, par, train = config.model, config.parallel, config.train
    layout = build_layout(model, par, train, world_size)
    if layout.fsdp and model.num_experts:  # planner/sharded.py times its gathers against dense layers, knows no ep
        raise LayoutError(
            f"parallel.fsdp=true with model.num_experts={model.num_experts}: the planner does not model FSDP of an "
            "MoE model; use the distributed optimizer"
        )
    ep = ep_size_of(config) if ep_size is None else ep_size
    comms = LayoutCollectives(config, layout, software, ep)
    experts = expert_grid(layout, ep) if comms.experts is not None else None
    hw = Hardware(cluster, fp32=train.precision == "fp32", grid=RankGrid.of(layout), experts=experts)
    shape = shape_from_config(config, layout, attention=cluster.efficiency.attention)
    costs = _Costs(config, layout, hw, shape, comms)
    plan = CommPlan(costs.step, par.overlap_p2p_comm, comms.plans) if software.planned_p2p else None
    timeline = simulate(
        comms.lists,
        layout.vp_size,
        layout.num_microbatches,
        action_cost=lambda r, a: costs.of(r, a).total,
        v_shape=comms.run.stages.v_shape,
        comm=plan,
    )
    events_by_rank: list[list[Event]] = [[] for _ in range(layout.pp_size)]
    for event in timeline.events:
        events_by_rank[event.rank].append(event)
    critical, total, parts = 0, -1.0, {}
    for r in range(layout.pp_size):
        rank_parts = _rank_parts(config, costs, r, events_by_rank[r], timeline, software)
        rank_total = sum(rank_parts.values())
        if rank_total > total:
            critical, total, parts = r, rank_total, rank_parts
    memory = memory_of(config, layout, cluster, shape, software, ep)
    flops = comms.run.flops.with_recompute  # the paper's achieved FLOPs (an MoE model's: its active GEMMs)
    backwards = (a for a in comms.lists[critical] if a.op in (Op.BACKWARD, Op.BACKWARD_INPUT))
    recompute = sum(costs.recompute_per_chunk for _ in backwards)
    size = checkpoint_bytes(config, comms)
    read, write = cluster.storage_read_gbs, cluster.storage_write_gbs
    return Prediction(
        layout,
        train.micro_batch_size,
        train.recompute,
        total,
        flops,
        parts,
        recompute,
        memory,
        cluster.memory_gib,
        timeline.bubble_fraction,
        layout_traffic(comms, hw, total),
        size,
        size / (write * 1e9) if write else None,
        size / (read * 1e9) if read else None,
        ep,
    )


def fusion_speedup(
    config: Config, cluster: ClusterSpec, world_size: int, fused: Prediction, software: Software = TRAINER
) -> float:
    """Throughput with the config's fused kernels over the same run with none selected (planner/fusion.py:
    the unfused chains' extra HBM traffic); 1.0 when the config selects none. `fused` is `config`'s prediction."""
    model = dataclasses.replace(config.model, fused_kernels=False, fused_kernel_names=None)
    unfused = predict(dataclasses.replace(config, model=model), cluster, world_size, software)
    return unfused.iteration_seconds / fused.iteration_seconds


def _rank_parts(
    config: Config, costs: _Costs, pp_rank: int, events: list[Event], timeline: Timeline, software: Software
) -> dict[str, float]:
    """The time of pipeline rank `pp_rank`, split as BREAKDOWN_KEYS (sums to the rank's iteration time)."""
    layout, comms = costs.layout, costs.comms
    spent = [costs.of(pp_rank, e.action) for e in events]
    compute = sum(c.compute for c in spent)
    tp_comm = sum(c.tp_comm for c in spent)
    ep_comm = sum(c.ep_comm for c in spent)
    sharded_comm = sum(c.dp_comm for c in spent)
    # the plan's batch transfers the rank waited for, or its synchronous sends
    pp_comm = timeline.exposed_comm[pp_rank] + sum(c.pp_comm for c in spent)
    busy = compute + tp_comm + pp_comm + sharded_comm + ep_comm
    bubble = max(0.0, timeline.finish[pp_rank] - busy)  # rounding: -1e-16 on a stage
    buckets = [collective_seconds_of(costs.hw, c) for c in comms.grad_reduction(pp_rank)]
    dp_seconds = sum(buckets)
    dp_comm = _dp_exposed(events, dp_seconds, buckets[-1]) if software.overlap_grad_reduce and buckets else dp_seconds
    dp_comm += sharded_comm
    after = comms.finalize(pp_rank) + comms.optimizer(pp_rank) + comms.loss()
    tp_comm += costs.seconds([c for c in after if c.group == "tp"])  # sequence-parallel grads
    dp_comm += costs.seconds([c for c in after if c.group != "tp"])
    ep = 1 if comms.experts is None else comms.experts.ep_size
    layers = rank_layer_ids(comms.run, pp_rank)
    roles = comms.run.chunk_roles(pp_rank)
    params = rank_params(config.model, layout.tp_size, layout.pp_size, roles, ep, layers)
    expert_params = routed_expert_params(config.model, layers, ep)  # the rank's E / ep routed experts
    dp_cp = layout.dp_size * layout.cp_size
    expert_dp = dp_cp if comms.experts is None else comms.experts.expert_dp_size
    if comms.sharded is not None:  # the step on the rank's shards (the masters are the shards: no copy-back)
        optimizer = costs.hw.memory_seconds(software.step_bytes * comms.sharded.params_per_shard)
    else:
        distributed = config.parallel.distributed_optimizer
        step, copy = software.step_bytes, software.copy_bytes
        # the optimizer shards over dp x cp, the experts' state over expert-dp
        optimizer = optimizer_seconds(params - expert_params, dp_cp, distributed, costs.hw, step, copy)
        optimizer += optimizer_seconds(expert_params, expert_dp, distributed, costs.hw, step, copy)
    return {
        "compute": compute,
        "bubble": bubble,
        "tp_comm": tp_comm,
        "ep_comm": ep_comm,
        "pp_comm": pp_comm,
        "dp_comm": dp_comm,
        "optimizer": optimizer,
    }
