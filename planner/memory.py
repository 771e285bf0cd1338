"""Bytes per GPU of a layout: model state by precision and optimizer, activations of the in-flight
micro-batches as the schedule lists hold them, the recomputation working set and a stated allowance.

Model state per parameter (what optim/optimizer.py and parallel/data_parallel.py allocate, measured in
docs/performance.md "Optimizer memory"): weights in the param dtype (4 B fp32, 2 B bf16/fp16), fp32 main
grads (4 B), and the optimizer: fp32 plain keeps only the two Adam moments (8 B; the fp32 params are their own
masters), bf16/fp16 plain fp32 masters + moments (12 B), the distributed optimizer 12/dp B in every precision.
With FSDP (ZeRO-3) every byte of it is sharded, plus what is gathered at once (planner/sharded.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from model.shape import count_moe_layers, rank_params, routed_expert_params
from parallel.layout import Layout
from parallel.pipeline.schedules import Action, Op, build_schedule, unhandled_op
from parallel.run_shape import RunShape
from planner.activations import (
    ActivationShape,
    attention_score_bytes,
    embedding_activation_bytes,
    head_activation_bytes,
    layer_activation_bytes,
)
from planner.experts import ExpertLayout, moe_activation_delta
from planner.sharded import ShardedCollectives, sharded_state_bytes
from planner.software import TRAINER, Software

if TYPE_CHECKING:
    from config.schema import Config, TrainConfig
    from model.config import ModelConfig

GIB = 2.0**30


def state_bytes_per_param(precision: str, distributed_optimizer: bool, dp_size: int) -> dict[str, float]:
    """{"weights", "grads", "optimizer"} bytes per parameter."""
    weights = 4.0 if precision == "fp32" else 2.0
    if distributed_optimizer:
        optimizer = 12.0 / dp_size
    else:
        optimizer = 8.0 if precision == "fp32" else 12.0
    return {"weights": weights, "grads": 4.0, "optimizer": optimizer}


def model_state_bytes(
    params: int,
    expert_params: int,
    precision: str,
    distributed_optimizer: bool,
    dp_cp_size: int,
    expert_dp_size: int,
) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes of a rank's `params`, of which `expert_params` are routed experts:
    the distributed optimizer shards the experts' state over their expert-dp group and the rest over dp x cp
    (ep = 1: the same group)."""
    state = state_bytes_per_param(precision, distributed_optimizer, dp_cp_size)
    expert_optimizer = state_bytes_per_param(precision, distributed_optimizer, expert_dp_size)["optimizer"]
    optimizer = (params - expert_params) * state["optimizer"] + expert_params * expert_optimizer
    return params * state["weights"], params * state["grads"], optimizer


def rank_layer_ids(run: RunShape, pp_rank: int) -> list[int]:
    """The global layers pipeline rank `pp_rank` holds, over all its chunks."""
    return [layer for chunk in run.chunks(pp_rank) for layer in chunk.layer_ids]


def peak_in_flight_bytes(actions: list[Action], chunk_bytes: list[float]) -> float:
    """Largest sum of chunk_bytes[chunk] over the (micro-batch, chunk) forwards whose backward has not run.

    This is the bound the executor measures (ScheduleResult.max_in_flight), weighted by what each chunk keeps.
    """
    live = peak = 0.0
    for action in actions:
        match action.op:
            case Op.FORWARD:
                live += chunk_bytes[action.chunk]
                peak = max(peak, live)
            case Op.BACKWARD | Op.WEIGHT:  # zero bubble: held until the weight gradients ran
                live -= chunk_bytes[action.chunk]
            case Op.BACKWARD_INPUT:
                pass
            case _:
                unhandled_op(action.op)
    return peak


def max_in_flight(actions: list[Action]) -> int:
    """Largest number of (micro-batch, chunk) forwards awaiting their backward."""
    return int(peak_in_flight_bytes(actions, [1.0] * (max(a.chunk for a in actions) + 1)))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU (the busiest pipeline rank)."""

    pp_rank: int
    params: int  # parameters held by this rank
    weights: float
    grads: float
    optimizer: float
    activations: float  # kept for the in-flight micro-batches
    working_set: float  # transient: one layer's recomputed intermediates or the logits' gradient
    allowance: float  # CUDA context, communication buffers (the cluster spec's figure)
    fragmentation: float = 0.0  # the caching allocator's overhead on the activations (cluster spec's fraction)

    @property
    def total(self) -> float:
        kept = self.activations + self.working_set + self.fragmentation
        return self.weights + self.grads + self.optimizer + kept + self.allowance

    def as_gib(self) -> dict[str, float]:
        fields = {k: v for k, v in asdict(self).items() if k not in ("pp_rank", "params")}
        return {**{k: v / GIB for k, v in fields.items()}, "total": self.total / GIB}


def rank_memory(
    model: ModelConfig,
    layout: Layout,
    train: TrainConfig,
    distributed_optimizer: bool,
    shape: ActivationShape,
    pp_rank: int,
    allowance_bytes: float,
    activation_overhead: float = 0.0,
    model_state: tuple[float, float, float] | None = None,
    ep_size: int = 1,
) -> MemoryEstimate:
    """Memory of pipeline rank `pp_rank` under `layout` (a parallel.layout.Layout); `activation_overhead`
    is the allocator's extra as a fraction of the kept activations (ClusterSpec.activation_overhead);
    `model_state`, when given, is the (weights, grads, optimizer) bytes (FSDP's: planner/sharded.py); an MoE
    model's experts sit over `ep_size` ranks (model/shape.py counts the rank's E / ep of them,
    planner/experts.py what an MoE layer keeps for backward)."""
    run = RunShape(model, layout, train)
    roles = run.chunk_roles(pp_rank)
    layers = rank_layer_ids(run, pp_rank)
    params = rank_params(model, layout.tp_size, layout.pp_size, roles, ep_size, layers)
    recompute = train.recompute
    per_layer = layer_activation_bytes(shape, recompute)
    experts = ExpertLayout.of(model, layout, ep_size) if model.num_experts else None
    moe_delta = 0.0  # what an MoE layer keeps beyond the dense layer's count
    if experts is not None and recompute != "full":
        moe_delta = moe_activation_delta(model, experts, shape.local_seq * shape.micro_batch, shape.value_bytes)
    chunk_bytes = [
        per_layer * len(chunk.layer_ids) + moe_delta * count_moe_layers(model, chunk.layer_ids)
        for chunk in run.chunks(pp_rank)
    ]
    head = head_activation_bytes(shape, run.padded_vocab)
    holds_head = run.roles(pp_rank).holds_head
    for chunk, (pre, post) in enumerate(roles):
        chunk_bytes[chunk] += (embedding_activation_bytes(shape) if pre else 0.0) + (head if post else 0.0)
    actions = build_schedule(layout.schedule, layout.pp_size, pp_rank, layout.num_microbatches, layout.vp_size)
    activations = peak_in_flight_bytes(actions, chunk_bytes)
    if recompute == "full":
        working = layer_activation_bytes(shape, "none")
        if experts is not None:  # the recomputed layer is an MoE one
            tokens = shape.local_seq * shape.micro_batch
            working += max(0.0, moe_activation_delta(model, experts, tokens, shape.value_bytes))
    elif recompute == "selective":
        working = attention_score_bytes(shape)
    else:
        working = 0.0
    if holds_head:  # the logits' gradient (fp32) exists while the head runs backward
        working = max(working, 4.0 * shape.local_seq * shape.micro_batch * run.vocab_local)
    # the distributed optimizer shards over dp x cp (context-parallel ranks hold replicas too), the experts'
    # state over expert-dp = dp x cp / ep
    dp_cp = layout.dp_size * layout.cp_size
    expert_dp = dp_cp if experts is None else experts.expert_dp_size
    expert_params = routed_expert_params(model, layers, ep_size)
    weights, grads, optimizer = model_state or model_state_bytes(
        params, expert_params, train.precision, distributed_optimizer, dp_cp, expert_dp
    )
    return MemoryEstimate(
        pp_rank,
        params,
        weights,
        grads,
        optimizer,
        activations,
        working,
        allowance_bytes,
        activation_overhead * activations,
    )


def layout_memory(
    model: ModelConfig,
    layout: Layout,
    train: TrainConfig,
    distributed_optimizer: bool,
    shape: ActivationShape,
    allowance_bytes: float,
    activation_overhead: float = 0.0,
    model_state: tuple[float, float, float] | None = None,
    ep_size: int = 1,
) -> MemoryEstimate:
    """The busiest rank: pipeline rank 0 holds the most micro-batches in flight and the embedding, the head's
    rank the output layer and the logits, the last rank (zb-v: the turn of the V) as many micro-batches as
    rank 0 with the V placement; the ranks between hold less."""
    ranks = {0, layout.stages.head_pp_rank, layout.pp_size - 1}
    estimates = [
        rank_memory(
            model,
            layout,
            train,
            distributed_optimizer,
            shape,
            r,
            allowance_bytes,
            activation_overhead,
            model_state,
            ep_size,
        )
        for r in sorted(ranks)
    ]
    return max(estimates, key=lambda e: e.total)


def config_memory(
    config: Config,
    layout: Layout,
    shape: ActivationShape,
    allowance_bytes: float,
    activation_overhead: float = 0.0,
    software: Software = TRAINER,
    ep_size: int = 1,
) -> MemoryEstimate:
    """layout_memory of a config (model, parallel and train sections), FSDP's sharded model state included, an
    MoE model's experts over `ep_size` ranks."""
    model_state = None
    if layout.fsdp:
        sharded = ShardedCollectives(config, layout, RunShape(config.model, layout, config.train), software)
        model_state = sharded_state_bytes(sharded, float(shape.value_bytes))
    return layout_memory(
        config.model,
        layout,
        config.train,
        config.parallel.distributed_optimizer,
        shape,
        allowance_bytes,
        activation_overhead,
        model_state,
        ep_size,
    )
