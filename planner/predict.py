"""Predict one layout: iteration time, TFLOP/s per GPU, memory per GPU and where the time goes.

The pipeline part is not a formula: every pipeline rank's action list from parallel.pipeline.schedules runs
through parallel.pipeline.simulator with this layout's costs (a chunk's compute and tensor-parallel
collectives, plus the synchronous send of its output when a peer needs it, the messages being those of
parallel.pipeline.p2p), so the bubble and the communication stalls are those of the lists the trainer runs.
After the pipeline: the data-parallel gradient reduction (overlapped with the last backward of each chunk,
as the trainer's buckets are), the tied-embedding all-reduce, the optimizer step and, with the distributed
optimizer, the parameter all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model.shape import rank_params
from parallel.layout import Layout, build_layout, uses_v_shape
from parallel.pipeline.p2p import produced_message
from parallel.pipeline.schedules import Action, Op, build_schedule, unhandled_op
from parallel.pipeline.simulator import simulate_lists
from parallel.rank_grid import RankGrid
from parallel.run_shape import TIED_GROUP, RunShape
from planner.activations import shape_from_config
from planner.cluster import ClusterSpec
from planner.costs import Hardware, head_times, layer_times, optimizer_seconds, p2p_seconds
from planner.memory import GIB, MemoryEstimate, layout_memory

BREAKDOWN_KEYS = ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm", "optimizer")


@dataclass(frozen=True)
class Software:
    """What the training software does that the config does not say: the bytes per gradient element it
    reduces over dp, whether the reduction overlaps the backward (this trainer: fp32, bucketed), and the HBM
    bytes its optimizer step moves per element of the rank's optimizer shard (`step_bytes`: this trainer's
    AdamW reads grad, master, moments and writes master, moments) and per local parameter outside the shard
    (`copy_bytes`: the grad-norm read and the 16-bit copy-back)."""

    grad_reduce_bytes: float = 4.0
    overlap_grad_reduce: bool = True
    step_bytes: float = 28.0
    copy_bytes: float = 6.0


TRAINER = Software()


@dataclass(frozen=True)
class ActionCost:
    """Seconds of one action on one rank, by kind."""

    compute: float
    tp_comm: float
    pp_comm: float

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.pp_comm


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
        return (
            f"tp {lay.tp_size} pp {lay.pp_size} vp {lay.vp_size} dp {lay.dp_size} mb {self.micro_batch_size} "
            f"recompute {self.recompute}{sp}"
        )

    def to_dict(self) -> dict[str, Any]:
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
        }


class _Costs:
    """Per-action costs of one layout: compute and tp collectives per chunk, plus the send of its output."""

    def __init__(self, config: Any, layout: Layout, hw: Hardware, shape: Any):
        model, train = config.model, config.train
        p, v = layout.pp_size, layout.vp_size
        self.layout, self.run = layout, RunShape.of(config, layout)
        per_chunk = self.run.stages.layers_per_chunk(model.num_layers)
        layer = layer_times(shape, model, hw, train.recompute)
        self.recompute_per_chunk = per_chunk * layer.recompute
        head_f, head_b = head_times(shape, model, hw, self.run.padded_vocab)
        sbh_bytes = shape.local_seq * shape.micro_batch * shape.hidden * shape.value_bytes
        boundary = hw.collective_seconds("all_reduce", sbh_bytes, layout.tp_size, hw.per_node("tp"))  # embedding / head
        embed = hw.memory_seconds(3 * sbh_bytes)
        last = p * v - 1
        self.forward, self.backward, self.weight = {}, {}, {}
        for stage in range(p * v):
            compute_f, compute_b = per_chunk * layer.forward, per_chunk * layer.backward
            tp_f, tp_b = per_chunk * layer.tp_forward, per_chunk * layer.tp_backward
            if stage == 0:
                compute_f, compute_b, tp_f = compute_f + embed, compute_b + embed, tp_f + boundary
            if stage == last:
                compute_f, compute_b, tp_b = compute_f + head_f, compute_b + head_b, tp_b + boundary
            self.forward[stage] = (compute_f, tp_f)
            self.backward[stage] = (compute_b, tp_b)
            # zero bubble's WEIGHT: the weight GEMMs; the first stage has no input gradient, so all of it
            self.weight[stage] = (compute_b, tp_b) if stage == 0 else (per_chunk * layer.weight_grad, 0.0)
        inter = hw.crosses_nodes("pp")
        self.send = p2p_seconds(shape, hw, inter, bool(config.parallel.scatter_gather)) if p > 1 else 0.0

        self._cache: dict[tuple[int, Op, int], ActionCost] = {}

    def of(self, pp_rank: int, action: Action) -> ActionCost:
        """The cost of `action` on pipeline rank `pp_rank` (the same for every micro-batch)."""
        key = (pp_rank, action.op, action.chunk)
        cost = self._cache.get(key)
        if cost is None:
            p, v = self.layout.pp_size, self.layout.vp_size
            v_shape = self.run.stages.v_shape
            stage = self.run.stages.virtual_stage(pp_rank, action.chunk)
            match action.op:
                case Op.FORWARD:
                    compute, tp = self.forward[stage]
                case Op.BACKWARD:
                    compute, tp = self.backward[stage]
                case Op.BACKWARD_INPUT:
                    compute, tp = (b - w for b, w in zip(self.backward[stage], self.weight[stage]))
                case Op.WEIGHT:
                    compute, tp = self.weight[stage]
                case _:
                    unhandled_op(action.op)
            out = produced_message(action, pp_rank, p, v, v_shape)
            sends = out is not None and out[0] != pp_rank  # the turn of zb-v's V is local
            cost = self._cache[key] = ActionCost(compute, tp, self.send if sends else 0.0)
        return cost


def _dp_exposed(events: list, dp_seconds: float, bucket_seconds: float) -> float:
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


def memory_of(config: Any, layout: Layout, cluster: ClusterSpec, shape: Any) -> MemoryEstimate:
    """The busiest rank's memory with the cluster's allowance and allocator overhead."""
    allowance = cluster.memory_allowance_gib * GIB
    return layout_memory(
        config.model,
        layout,
        config.train,
        config.parallel.distributed_optimizer,
        shape,
        allowance,
        cluster.activation_overhead,
    )


def predict(config: Any, cluster: ClusterSpec, world_size: int, software: Software = TRAINER) -> Prediction:
    """Predict the layout `config` describes on `world_size` GPUs of `cluster` (LayoutError if invalid), as
    `software` runs it (default: this trainer)."""
    model, par, train = config.model, config.parallel, config.train
    layout = build_layout(model, par, train, world_size)
    hw = Hardware(cluster, fp32=train.precision == "fp32", grid=RankGrid.of(layout))
    shape = shape_from_config(model, par, train, attention=cluster.efficiency.attention)
    costs = _Costs(config, layout, hw, shape)
    p, v, m = layout.pp_size, layout.vp_size, layout.num_microbatches
    lists = [build_schedule(layout.schedule, p, r, m, v) for r in range(p)]
    timeline = simulate_lists(
        lists, v, m, action_cost=lambda r, a: costs.of(r, a).total, v_shape=uses_v_shape(layout.schedule)
    )
    events_by_rank: list[list] = [[] for _ in range(p)]
    for event in timeline.events:
        events_by_rank[event.rank].append(event)
    critical, total, parts = 0, -1.0, {}
    for r in range(p):
        rank_parts = _rank_parts(config, layout, hw, costs, lists[r], r, events_by_rank[r], software)
        rank_total = sum(rank_parts.values())
        if rank_total > total:
            critical, total, parts = r, rank_total, rank_parts
    memory = memory_of(config, layout, cluster, shape)
    flops = costs.run.flops.with_recompute  # the paper's
    recompute = sum(costs.recompute_per_chunk for a in lists[critical] if a.op in (Op.BACKWARD, Op.BACKWARD_INPUT))
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
    )


def _rank_parts(
    config: Any,
    layout: Layout,
    hw: Hardware,
    costs: _Costs,
    actions: list[Action],
    pp_rank: int,
    events: list,
    software: Software,
) -> dict[str, float]:
    """The time of pipeline rank `pp_rank`, split as BREAKDOWN_KEYS (sums to the rank's iteration time)."""
    model, par, train = config.model, config.parallel, config.train
    spent = [costs.of(pp_rank, a) for a in actions]
    compute = sum(c.compute for c in spent)
    tp_comm = sum(c.tp_comm for c in spent)
    pp_comm = sum(c.pp_comm for c in spent)
    params = rank_params(model, layout.tp_size, layout.pp_size, costs.run.chunk_roles(pp_rank))
    # gradients are reduced over dp x cp (the cp ranks hold replicas of every parameter)
    dp, dp_node = layout.dp_size * layout.cp_size, hw.per_node("dp", "cp")
    kind = "reduce_scatter" if par.distributed_optimizer else "all_reduce"
    grad_bytes = software.grad_reduce_bytes * params
    dp_seconds = hw.collective_seconds(kind, grad_bytes, dp, dp_node)
    bucket = hw.collective_seconds(kind, min(grad_bytes, par.grad_bucket_size_mb * 2**20), dp, dp_node)
    end = max(e.end for e in events)
    dp_comm = _dp_exposed(events, dp_seconds, bucket) if software.overlap_grad_reduce else dp_seconds
    if par.distributed_optimizer:
        param_bytes = 4.0 if train.precision == "fp32" else 2.0
        dp_comm += hw.collective_seconds("all_gather", param_bytes * params, dp, dp_node)
    if costs.run.roles(pp_rank).tied_reduction == TIED_GROUP:  # zb-v's rank 0 sums its two copies itself
        embedding_bytes = 4.0 * costs.run.vocab_local * model.hidden_size
        dp_comm += hw.collective_seconds("all_reduce", embedding_bytes, 2, 1)
    optimizer = optimizer_seconds(params, dp, par.distributed_optimizer, hw, software.step_bytes, software.copy_bytes)
    bubble = max(0.0, end - (compute + tp_comm + pp_comm))  # rounding can leave -1e-16 on one stage
    return {
        "compute": compute,
        "bubble": bubble,
        "tp_comm": tp_comm,
        "pp_comm": pp_comm,
        "dp_comm": dp_comm,
        "optimizer": optimizer,
    }
