"""The collectives a layout issues per rank and iteration: the planner's list, which its time model charges.

`LayoutCollectives(config, layout, software)` says, for every place of an iteration, what the trainer sends:

    action(stage, op)        a forward / backward of one virtual stage: the tensor-parallel regions (two
                             all-reduces per layer each way, or all-gathers and reduce-scatters with sequence
                             parallelism), the embedding's and the head's, the vocab-parallel loss's three
                             reductions, the forward collectives again where recomputation repeats them, and the
                             sends and receives of ring attention under context parallelism
    step(step)               one batch of the pipeline plan (p2p.plan_steps: what the executor posts), with the
                             tp all-gather that completes each scattered receive
    grad_reduction(pp_rank)  the data-parallel reduction, bucket by bucket as parallel/data_parallel.py cuts it
                             (plan_buckets) or, for software that does, one flattened collective
    finalize(pp_rank, ..)    the tied embedding over the embedding group (never under zb-v, whose rank 0 sums
                             its two copies itself) and the sequence-parallel grads over tp, on the part the
                             rank owns
    optimizer(pp_rank)       the inf check (fp16), the grad norm's scalars, the distributed optimizer's gathers
    loss()                   the loss's scalars over cp, pp and dp
    sharded                  with parallel.fsdp (ZeRO-3): FSDP's gathers and reductions per unit and micro-batch
                             (planner/sharded.py), which replace the buckets
    rank(pp_rank, dp_cp)     all of it for one rank, in no particular order

planner/predict.py charges exactly these (a tp collective as NCCL's ring, a send as one link transfer), so what
it charges and what it lists cannot differ; tests/planner/test_collectives.py compares `rank(...)` with what
the trainer issued on gloo (parallel/comm.py's recorder), exactly, for several layouts.

Not listed, and not in the recorded "train" region either: start-up (with the one world barrier after the first
iteration, before the training timeout applies: operations/watchdog.py), evaluation, checkpoints, the
iteration-boundary agreement (operations/guards.agree: one 24-byte world all-reduce per iteration, recorded under
"boundary"; a control message, not training work) and the straggler report (operations/straggler.py: one world
all-gather of 2 float64 per rank every logging.straggler_interval iterations, recorded under "report"). Known inexactness: under a zero-bubble schedule with full
recomputation the trainer recomputes a checkpointed layer again in WEIGHT once per parameter group
(parallel/pipeline/weight_grad.py); the list counts one recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from model.shape import ParamShape, chunk_parameters
from parallel.data_parallel import owned_slice, plan_buckets, shard_range
from parallel.layout import Layout
from parallel.pipeline.p2p import Step, plan_steps
from parallel.pipeline.schedules import Action, Op, build_schedule, unhandled_op
from parallel.pipeline.stages import ChunkPlacement
from parallel.run_shape import TIED_GROUP, RunShape
from planner.collective import Collective
from planner.experts import ExpertLayout, dispatch_exchanges
from planner.sharded import ShardedCollectives
from planner.software import TRAINER, Software

if TYPE_CHECKING:
    from config.schema import Config


@dataclass(frozen=True)
class ActionCollectives:
    """What one action issues, split by how the time model charges it: tp collectives in full, ring transfers
    beyond the block attention they overlap (a forward block, or a backward one)."""

    tp: tuple[Collective, ...] = ()
    ring_forward: tuple[Collective, ...] = ()
    ring_backward: tuple[Collective, ...] = ()
    ep: tuple[Collective, ...] = ()  # expert parallelism's all-to-alls, charged in full (planner/experts.py)

    @property
    def all(self) -> tuple[Collective, ...]:
        return self.tp + self.ring_forward + self.ring_backward + self.ep


@dataclass
class _Bucket:
    """One gradient bucket of a rank: buffer range (padded) and its params' ranges."""

    start: int
    end: int
    params: list[tuple[ParamShape, int, int]] = field(default_factory=list)  # (param, buffer start, end)
    expert: bool = False  # expert weights: reduced and sharded over the expert-dp group


class LayoutCollectives:
    """The collectives of one layout (module docstring); every method is pure arithmetic."""

    def __init__(self, config: Config, layout: Layout, software: Software = TRAINER, ep_size: int = 1):
        self.config, self.layout, self.software = config, layout, software
        self.run = RunShape.of(config, layout)
        model, par, train = config.model, config.parallel, config.train
        lay = layout
        # an MoE model's experts over ep_size ranks (planner/experts.py); None for a dense model
        self.experts = ExpertLayout.of(model, layout, ep_size) if model.num_experts else None
        self.value_bytes = 4 if train.precision == "fp32" else 2  # activations and params
        seq, b = self.run.local_seq_length, train.micro_batch_size
        self.sbh = seq * b * model.hidden_size * self.value_bytes  # one [s, b, h] activation (full s/cp)
        self.loss_scalars = 4 * seq * b  # the loss's fp32 [s, b] statistics
        self.kv_block = 2 * b * (model.query_groups // lay.tp_size) * seq * model.head_dim * self.value_bytes
        self.sp = lay.sequence_parallel and lay.tp_size > 1
        self.tp = ("tp", lay.tp_size)
        self.dp_cp = ("dp" if lay.cp_size == 1 else "dp_cp", lay.dp_size * lay.cp_size)
        message = 1
        for size in self.run.activation_shape:
            message *= size
        self.message_numel = message
        self.scatter = bool(par.scatter_gather) and not lay.sequence_parallel and lay.tp_size > 1
        self.scatter = self.scatter and message % lay.tp_size == 0
        self._actions: dict[tuple[int, Op], ActionCollectives] = {}
        # ZeRO-3 / FSDP: its gathers and reductions replace the buckets
        self.sharded = ShardedCollectives(config, layout, self.run, software) if layout.fsdp else None

    # ---- the pipeline ------------------------------------------------------------------------------
    @cached_property
    def lists(self) -> list[list[Action]]:
        """Every pipeline rank's action list (parallel/pipeline/schedules.py)."""
        lay = self.layout
        return [
            build_schedule(lay.schedule, lay.pp_size, r, lay.num_microbatches, lay.vp_size) for r in range(lay.pp_size)
        ]

    @cached_property
    def plans(self) -> list[list[Step]]:
        """Every pipeline rank's plan of batches, as the executor runs it (p2p.plan_steps)."""
        return plan_steps(self.lists, self.layout.vp_size, self.run.stages.v_shape)

    def step(self, step: Step) -> tuple[Collective, ...]:
        """The sends and receives of one batch (1/tp of each activation with scatter/gather, whose receiving
        side then all-gathers it over tp)."""
        local = self.message_numel // self.layout.tp_size if self.scatter else self.message_numel
        found = []
        for kind, _, _ in step.ops:
            found.append(Collective(kind, "pp", self.layout.pp_size, local * self.value_bytes))
            if kind == "recv" and self.scatter:
                found.append(Collective("all_gather", *self.tp, self.message_numel * self.value_bytes))
        return tuple(found)

    # ---- one action ----------------------------------------------------------------------------------
    def action(self, stage: int, op: Op) -> ActionCollectives:
        """What a `op` action of virtual stage `stage` issues, per micro-batch."""
        key = (stage, op)
        if key not in self._actions:
            self._actions[key] = self._action(stage, op)
        return self._actions[key]

    def _action(self, stage: int, op: Op) -> ActionCollectives:
        chunk = next(c for c in self.run.chunks(self.run.stages.stage_rank(stage)) if c.virtual_stage == stage)
        forward = ActionCollectives(
            self._forward_tp(chunk), self.ring(len(chunk.layer_ids), forward=True), ep=self._exchanges(chunk, True)
        )
        match op:
            case Op.FORWARD:
                return forward
            case Op.BACKWARD:
                return self._backward(chunk)
            case Op.BACKWARD_INPUT:  # the first stage has no input gradient: its whole backward is its WEIGHT
                return ActionCollectives() if chunk.pre_process else self._backward(chunk)
            case Op.WEIGHT:
                return self._backward(chunk) if chunk.pre_process else ActionCollectives()
            case _:
                unhandled_op(op)

    def layer(self, forward: bool) -> ActionCollectives:
        """What one layer issues one way per micro-batch (forward, or backward without recomputation)."""
        ring_forward, ring_backward = (self.ring(1, True), ()) if forward else ((), self.ring(1, False))
        return ActionCollectives(tuple(self._tp_layer()), ring_forward, ring_backward)

    def _tp_layer(self, layer: int | None = None) -> list[Collective]:
        """One layer's tp collectives one way: 2 all-reduces, or (sequence parallel) an all-gather before each
        column-parallel GEMM and a reduce-scatter after each row-parallel one (backward: the same, swapped).
        An MoE layer (global index `layer`) has attention's only: its MLP part is replicated over tp."""
        if self.layout.tp_size == 1:
            return []
        halves = 1 if layer is not None and self.config.model.is_moe_layer(layer) else 2
        if not self.sp:
            return [Collective("all_reduce", *self.tp, self.sbh)] * halves
        pair = [Collective("all_gather", *self.tp, self.sbh), Collective("reduce_scatter", *self.tp, self.sbh)]
        return pair * halves

    def _recomputed_tp_layer(self, layer: int | None = None) -> list[Collective]:
        """A layer's forward collectives as full recomputation repeats them: torch's checkpoint stops once the
        last tensor backward needs is recomputed (early stop), so the reduction after fc2 is skipped unless a
        hidden dropout after it keeps a mask to recompute. An MoE layer's last tp collective is attention's,
        whose output the MoE part needs: all of them are repeated."""
        found = self._tp_layer(layer)
        moe = layer is not None and self.config.model.is_moe_layer(layer)
        return found if moe or self.config.model.hidden_dropout > 0 else found[:-1]

    def _routing_counts(self, layer: int) -> list[Collective]:
        """The load-balancing loss's expert counts of MoE layer `layer` in forward, summed over the ranks holding
        other parts of the micro-batch: cp, then tp under sequence parallelism (int64 [E], or [b x E] per
        sequence for seq_aux_loss); none without the loss or without such ranks."""
        model, lay = self.config.model, self.layout
        balancing = model.moe_router_load_balancing_type
        if not model.is_moe_layer(layer) or model.moe_aux_loss_coeff <= 0 or balancing == "none":
            return []
        columns = (model.num_experts or 0) * (self.config.train.micro_batch_size if balancing == "seq_aux_loss" else 1)
        groups = [("cp", lay.cp_size)] if lay.cp_size > 1 else []
        groups += [self.tp] if self.sp else []
        return [Collective("all_reduce", name, size, 8 * columns) for name, size in groups]

    def _exchanges(self, chunk: ChunkPlacement, forward: bool) -> tuple[Collective, ...]:
        """Expert parallelism's all-to-alls of the chunk's MoE layers for one micro-batch: forward, or backward
        with the forward ones again for the layers full recomputation repeats."""
        experts = self.experts
        if experts is None or experts.ep_size == 1:
            return ()
        model, tokens = self.config.model, self.run.local_seq_length * self.config.train.micro_batch_size

        def one(way: bool) -> list[Collective]:
            exchanges = dispatch_exchanges(model, experts, tokens, self.value_bytes, way)
            return [Collective("all_to_all", "ep", experts.ep_size, int(e.nbytes)) for e in exchanges]

        moe = [layer for layer in chunk.layer_ids if model.is_moe_layer(layer)]
        if forward:
            return tuple(one(True) * len(moe))
        again = [layer for layer in self.run.recomputed_layers(chunk) if model.is_moe_layer(layer)]
        return tuple(one(False) * len(moe) + one(True) * len(again))

    def _forward_tp(self, chunk: ChunkPlacement) -> tuple[Collective, ...]:
        if self.layout.tp_size == 1:
            return tuple(c for layer in chunk.layer_ids for c in self._routing_counts(layer))  # cp's, if any
        found = []
        if chunk.pre_process:  # the vocab-parallel embedding's all-reduce
            found.append(Collective("all_reduce", *self.tp, self.sbh))
        for layer in chunk.layer_ids:
            found += self._tp_layer(layer) + self._routing_counts(layer)
        if chunk.post_process:  # the output layer's input (gathered under SP), the loss's max, target, sum
            if self.sp:
                found.append(Collective("all_gather", *self.tp, self.sbh))
            found += [Collective("all_reduce", *self.tp, self.loss_scalars)] * 3
        return tuple(found)

    def _backward(self, chunk: ChunkPlacement) -> ActionCollectives:
        recomputed = self.run.recomputed_layers(chunk)
        tp: list[Collective] = []
        if self.layout.tp_size > 1:
            if chunk.post_process:  # the output layer's input gradient
                tp.append(Collective("reduce_scatter" if self.sp else "all_reduce", *self.tp, self.sbh))
            for layer in chunk.layer_ids:
                tp += self._tp_layer(layer)
            for layer in recomputed:
                tp += self._recomputed_tp_layer(layer)
            if chunk.pre_process and self.sp:  # the sequence-parallel split after the embedding
                tp.append(Collective("all_gather", *self.tp, self.sbh))
        tp += [c for layer in recomputed for c in self._routing_counts(layer)]  # the recomputed router's
        again = len(recomputed) if recomputed else (len(chunk.layer_ids) if self._recomputes_core else 0)
        return ActionCollectives(
            tuple(tp),
            self.ring(again, forward=True),
            self.ring(len(chunk.layer_ids), forward=False),
            self._exchanges(chunk, forward=False),
        )

    @property
    def _recomputes_core(self) -> bool:
        return self.config.train.recompute == "selective"

    def ring(self, layers: int, forward: bool) -> tuple[Collective, ...]:
        """Ring attention's transfers in `layers` layers: forward, cp - 1 key/value blocks; backward, the blocks
        again (cp - 1) and their gradients (cp); each a send and a receive."""
        cp = self.layout.cp_size
        if cp == 1 or layers == 0:
            return ()
        hops = cp - 1 if forward else 2 * cp - 1
        pair = (Collective("send", "cp", cp, self.kv_block), Collective("recv", "cp", cp, self.kv_block))
        return pair * (hops * layers)

    # ---- after the pipeline ----------------------------------------------------------------------------
    def _buckets(self, pp_rank: int) -> list[_Bucket]:
        """The rank's gradient buckets, chunk by chunk, as parallel/data_parallel.py lays them out."""
        software, par = self.software, self.config.parallel
        chunks = [self._params(chunk) for chunk in self.run.chunks(pp_rank)]
        bucket_numel = max(1, int(par.grad_bucket_size_mb * 2**20) // int(software.grad_reduce_bytes))
        if not software.bucketed_grads:  # one flattened buffer of everything, one bucket
            chunks = [[(ParamShape(p.name, p.numel), expert) for params in chunks for p, expert in params]]
            bucket_numel = max(1, sum(p.numel for p, _ in chunks[0]))
        buckets = []
        for params in chunks:
            ordered = params[::-1]  # launch order: roughly the order backward produces gradients
            # each run of consecutive expert or other params is cut on its own, one after another (the trainer's
            # DataParallel._plan_chunk): expert buckets are reduced over another group
            runs: list[list[tuple[ParamShape, bool]]] = []
            for item in ordered:
                if runs and runs[-1][0][1] == item[1]:
                    runs[-1].append(item)
                else:
                    runs.append([item])
            offset = 0
            for run in runs:
                expert = run[0][1]
                pad_to = self._replicas(expert)[1] if par.distributed_optimizer else 1
                for start, end, indices in plan_buckets(
                    [(p.numel, p.shared_embedding) for p, _ in run], bucket_numel, pad_to
                ):
                    bucket = _Bucket(offset + start, offset + end, expert=expert)
                    position = bucket.start
                    for index in indices:
                        param = run[index][0]
                        bucket.params.append((param, position, position + param.numel))
                        position += param.numel
                    buckets.append(bucket)
                offset = buckets[-1].end
        return buckets

    def _replicas(self, expert: bool) -> tuple[str, int]:
        """The group holding replicas of a bucket's params: expert-dp for expert weights, dp x cp otherwise."""
        if expert and self.experts is not None:
            return ("expert_dp", self.experts.expert_dp_size)
        return self.dp_cp

    def _replica_rank(self, expert: bool, dp_cp_rank: int) -> int:
        """This rank's index in a bucket's replica group: in the experts' grid the dp x cp index is
        ep_rank + ep x expert_dp_rank."""
        if expert and self.experts is not None:
            return dp_cp_rank // self.experts.ep_size
        return dp_cp_rank

    def _params(self, chunk: ChunkPlacement) -> list[tuple[ParamShape, bool]]:
        """The chunk's parameters on one (tp, ep) rank and whether each is reduced over expert-dp."""
        model, lay, experts = self.config.model, self.layout, self.experts
        ep = 1 if experts is None else experts.ep_size
        params = chunk_parameters(
            model, lay.tp_size, chunk.layer_ids, chunk.pre_process, chunk.post_process, lay.sequence_parallel, ep
        )
        return [(param, experts is not None and experts.reduced_apart(param)) for param in params]

    def grad_reduction(self, pp_rank: int) -> list[Collective]:
        """The dp (x cp) reduction of the rank's gradients, one collective per bucket in launch order."""
        if self.sharded is not None:  # FSDP reduces per unit and micro-batch: `sharded`
            return []
        kind = "reduce_scatter" if self.config.parallel.distributed_optimizer else "all_reduce"
        element = int(self.software.grad_reduce_bytes)
        found = []
        for bucket in self._buckets(pp_rank):
            group = self._replicas(bucket.expert)
            if group[1] > 1:  # experts with ep = dp x cp, or one dp x cp rank: no other rank holds them
                found.append(Collective(kind, *group, (bucket.end - bucket.start) * element))
        return found

    def finalize(self, pp_rank: int, dp_cp_rank: int = 0) -> list[Collective]:
        """The tied embedding over the embedding group and the sequence-parallel grads over tp, on the part of
        each fp32 main grad the rank owns (all of it, or its distributed-optimizer shard; nothing is sent for
        an empty part)."""
        if self.sharded is not None:  # pp = 1: no tied copies; the sequence-parallel grads of the rank's shards
            owned = self.sharded.owned_numel(self.sharded.sequence_parallel_params(), dp_cp_rank)
            return [Collective("all_reduce", *self.tp, 4 * owned)] if self.layout.tp_size > 1 and owned else []
        owned_shared = owned_sp = 0
        for bucket in self._buckets(pp_rank):
            shard = (bucket.start, bucket.end)
            if self.config.parallel.distributed_optimizer:
                replicas = self._replicas(bucket.expert)[1]
                shard = shard_range(bucket.start, bucket.end, self._replica_rank(bucket.expert, dp_cp_rank), replicas)
            for param, start, end in bucket.params:
                lo, hi = owned_slice(shard, start, end)
                owned_shared += (hi - lo) if param.shared_embedding else 0
                owned_sp += (hi - lo) if param.sequence_parallel else 0
        found = []
        if self.run.roles(pp_rank).tied_reduction == TIED_GROUP and owned_shared:
            found.append(
                Collective("all_reduce", "embedding", len(self.run.stages.embedding_pp_ranks), 4 * owned_shared)
            )
        if self.layout.tp_size > 1 and owned_sp:
            found.append(Collective("all_reduce", *self.tp, 4 * owned_sp))
        return found

    def optimizer(self, pp_rank: int) -> list[Collective]:
        """The step's collectives: the inf/NaN check over the world (fp16), the grad norm's fp32 scalar over
        tp x pp (and dp x cp with the distributed optimizer), then the distributed optimizer's all-gather of
        every bucket's updated params."""
        lay, par = self.layout, self.config.parallel
        if lay.world_size == 1:
            return []
        found = []
        if self.config.train.precision == "fp16":
            found.append(Collective("all_reduce", "world", lay.world_size, 4))
        if self.experts is not None and self.experts.ep_size > 1 and not par.distributed_optimizer:
            # the experts' squares summed over ep first (the distributed optimizer's dp x cp spans ep already)
            found.append(Collective("all_reduce", "ep", self.experts.ep_size, 4))
        found.append(Collective("all_reduce", "tp_pp", lay.tp_size * lay.pp_size, 4))
        if self.sharded is not None:  # the norm over the shards: summed over the shard group, not the replicas
            return found + [Collective("all_reduce", *self.sharded.shard_group, 4)]
        if par.distributed_optimizer:
            found.append(Collective("all_reduce", *self.dp_cp, 4))
            for bucket in self._buckets(pp_rank):
                group = self._replicas(bucket.expert)
                if group[1] > 1 and bucket.end > bucket.start:
                    found.append(Collective("all_gather", *group, (bucket.end - bucket.start) * self.value_bytes))
        return found

    def loss(self) -> list[Collective]:
        """The iteration's loss: an fp32 scalar summed over cp and pp, averaged over dp."""
        lay = self.layout
        if lay.world_size == 1:
            return []
        sizes = (("cp", lay.cp_size), ("pp", lay.pp_size), ("dp", lay.dp_size))
        return [Collective("all_reduce", name, size, 4) for name, size in sizes if size > 1]

    # ---- one rank's iteration ----------------------------------------------------------------------------
    def rank(self, pp_rank: int, dp_cp_rank: int = 0) -> list[Collective]:
        """Everything pipeline rank `pp_rank` (dp x cp rank `dp_cp_rank`) issues in one iteration."""
        found: list[Collective] = []
        for step in self.plans[pp_rank]:
            found += self.step(step)
            if step.compute is not None:
                action = self.lists[pp_rank][step.compute]
                found += self.action(self.run.stages.virtual_stage(pp_rank, action.chunk), action.op).all
        if self.sharded is not None:
            found += self.sharded.iteration()
        found += self.grad_reduction(pp_rank) + self.finalize(pp_rank, dp_cp_rank)
        return found + self.optimizer(pp_rank) + self.loss()
