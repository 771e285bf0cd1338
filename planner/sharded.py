"""Sharded data parallelism (ZeRO-3, parallel.fsdp) in the planner: what an iteration issues, what it costs in time,
what it holds in memory.

What the trainer's FSDP2 issues (parallel/fsdp.py; tests/planner/test_collectives.py compares this list with a
recorded run, exactly): the chunk is one unit (embedding, final norm, head: gathered once per micro-batch and kept
until its backward) and every transformer layer another. Per micro-batch, each layer's parameters are all-gathered
before its forward and, with `parallel.fsdp_reshard_after_forward` (ZeRO-3), again before its backward; every
unit's gradients are reduce-scattered after its backward (with HSDP then all-reduced over the replicas). FSDP
splits each parameter along dim 0 into ceil(rows / n) rows per rank, so an all-gather carries n times the padded
shard (in the compute dtype: FSDP casts the fp32 shards), a reduce-scatter the padded gradient (fp32).

Time (`ShardedTimes`): a layer's gather runs while the previous layer computes (forward and backward prefetch),
up to `Software.prefetch_params` of its parameters; the reduce-scatters overlap the next layer's backward when the
software overlaps them (`overlap_grad_reduce`), else they wait in line. What does not fit under the compute is
exposed; the first gather of each pass and the last reductions always are. The network is shared: a backward
window carries the previous layer's gather and this layer's reduction one after the other. Each collective is
priced by planner/costs.py (NCCL's ring over the shard group, 8 ranks of each node in it when tp = 1), with
`Software.sharded_bandwidth` of its bandwidth, plus the HBM copies into and out of its flat buffer.

Memory: 16 bytes per parameter over the shard group (fp32 shard, fp32 gradient shard, the two Adam moments: the
shard is the master) plus what is gathered at once: the chunk's unit and two layers (the current one and the
prefetched one) in the gather dtype, one layer's unsharded gradient and its reduce-scatter buffer (per-parameter
software: one parameter and the prefetch budget).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from model.shape import ParamShape, chunk_parameters, fsdp_shard_rows
from parallel.layout import Layout
from parallel.run_shape import RunShape
from planner.collective import Collective
from planner.software import Software

if TYPE_CHECKING:
    from config.schema import Config


def gather_dtype_bytes(precision: str, software: Software) -> float:
    """Bytes per element the all-gathers carry: the software's, or the compute dtype's."""
    return software.gather_bytes or (4.0 if precision == "fp32" else 2.0)


class ShardedCollectives:
    """The collectives of one FSDP layout per rank (module docstring); pure arithmetic."""

    def __init__(self, config: Config, layout: Layout, run: RunShape, software: Software):
        self.config, self.layout, self.run, self.software = config, layout, run, software
        self.shards, self.replicas = layout.fsdp_shard_size, layout.fsdp_replicate
        if self.replicas > 1:
            self.shard_group = ("dp_shard", self.shards)
        else:
            self.shard_group = ("dp" if layout.cp_size == 1 else "dp_cp", self.shards)
        self.gather_bytes = gather_dtype_bytes(config.train.precision, software)
        self.reduce_bytes = software.grad_reduce_bytes
        self.reshard = bool(config.parallel.fsdp_reshard_after_forward)
        chunk = run.chunks(0)[0]  # FSDP runs with pp = 1: one chunk, the whole model
        params = chunk_parameters(config.model, layout.tp_size, chunk.layer_ids, True, True, layout.sequence_parallel)
        by_layer: dict[str, list[ParamShape]] = {str(i): [] for i in chunk.layer_ids}
        self.root: list[ParamShape] = []
        for param in params:  # one pass: searched per layer, a 100-layer model's planner search spent seconds here
            if param.name.startswith("layers."):
                by_layer.get(param.name.split(".", 2)[1], []).append(param)
            else:
                self.root.append(param)
        self.layers = [by_layer[str(i)] for i in chunk.layer_ids]

    # ---- one unit ------------------------------------------------------------------------------------
    def _calls(self, unit: list[ParamShape]) -> list[list[ParamShape]]:
        return [[p] for p in unit] if self.software.gather_per_param else [unit]

    def gather(self, unit: list[ParamShape]) -> list[Collective]:
        """The all-gather(s) of a unit's parameters: every rank's padded shard, in the gather dtype."""
        return [
            Collective(
                "all_gather", *self.shard_group, int(sum(p.padded_numel(self.shards) for p in call) * self.gather_bytes)
            )
            for call in self._calls(unit)
        ]

    def reduce(self, unit: list[ParamShape]) -> list[Collective]:
        """The reduce-scatter(s) of a unit's gradients (padded, in the reduce dtype) and, with HSDP, the all-reduce
        of the reduced shard over the replicas."""
        found = []
        for call in self._calls(unit):
            padded = sum(p.padded_numel(self.shards) for p in call)
            found.append(Collective("reduce_scatter", *self.shard_group, int(padded * self.reduce_bytes)))
            if self.replicas > 1:
                shard = padded // self.shards
                found.append(Collective("all_reduce", "dp_replicate", self.replicas, int(shard * self.reduce_bytes)))
        return found

    # ---- an iteration ----------------------------------------------------------------------------------
    def microbatch(self) -> list[Collective]:
        """One micro-batch: the chunk's unit gathered once, each layer before its forward and (reshard) its
        backward, every unit reduced."""
        found = self.gather(self.root)
        for layer in self.layers:
            found += self.gather(layer) * (2 if self.reshard else 1)
        for unit in (*self.layers, self.root):
            found += self.reduce(unit)
        return found

    def iteration(self) -> list[Collective]:
        return self.microbatch() * self.layout.num_microbatches

    def owned_numel(self, params: list[ParamShape], dp_cp_rank: int) -> int:
        """Elements of `params` in the shards of the rank at `dp_cp_rank` (its place in its replica)."""
        index = dp_cp_rank % self.shards
        total = 0
        for p in params:
            first, end = fsdp_shard_rows(p.dim0, self.shards, index)
            total += (end - first) * (p.numel // p.dim0)
        return total

    def sequence_parallel_params(self) -> list[ParamShape]:
        return [p for unit in (self.root, *self.layers) for p in unit if p.sequence_parallel]

    @property
    def params_per_shard(self) -> float:
        """Parameters one rank holds the shard of (padding included), for the memory and the optimizer."""
        return sum(p.padded_numel(self.shards) for unit in (self.root, *self.layers) for p in unit) / self.shards


@dataclass(frozen=True)
class ShardedTimes:
    """Seconds of the sharded collectives around one micro-batch's forward and backward (module docstring).

    `gather`, `reduce`: one layer's (per micro-batch); `root_gather`, `root_reduce`: the chunk's unit's;
    `layer_params`: parameters of one layer (how much of its gather the prefetch covers)."""

    gather: float
    reduce: float
    root_gather: float
    root_reduce: float
    layer_params: float
    layers: int
    reshard: bool
    software: Software

    @property
    def prefetched(self) -> float:
        """The part of a layer's gather that may run while the previous layer computes."""
        return min(1.0, self.software.prefetch_params / max(self.layer_params, 1.0))

    def forward_exposed(self, layer_forward: float) -> float:
        """Forward: the chunk's unit and the first layer gathered up front, each next layer behind the one before."""
        ahead = self.prefetched * self.gather
        later = self.gather - min(ahead, layer_forward)
        return self.root_gather + self.gather + (self.layers - 1) * later

    def backward_exposed(self, layer_backward: float) -> float:
        """Backward: the last layer gathered up front (with reshard), then per layer the previous layer's gather
        (behind this layer's backward, as far as prefetched) and this layer's reduction (overlapped when the
        software overlaps it: both share the network in that window); the last reductions at the end."""
        gather = self.gather if self.reshard else 0.0
        ahead = self.prefetched * gather
        if self.software.overlap_grad_reduce:
            per_layer = (gather - ahead) + max(0.0, ahead + self.reduce - layer_backward)
        else:
            per_layer = gather - min(ahead, layer_backward) + self.reduce
        return gather + (self.layers - 1) * per_layer + self.reduce + self.root_reduce


def sharded_times(sharded: ShardedCollectives, seconds_of: Callable[[Collective], float]) -> ShardedTimes:
    """The ShardedTimes of a layout; `seconds_of(collective)` prices one collective (bandwidth and HBM copies)."""
    layer = sharded.layers[0]
    return ShardedTimes(
        gather=sum(seconds_of(c) for c in sharded.gather(layer)),
        reduce=sum(seconds_of(c) for c in sharded.reduce(layer)),
        root_gather=sum(seconds_of(c) for c in sharded.gather(sharded.root)),
        root_reduce=sum(seconds_of(c) for c in sharded.reduce(sharded.root)),
        layer_params=float(sum(p.numel for p in layer)),
        layers=len(sharded.layers),
        reshard=sharded.reshard,
        software=sharded.software,
    )


def sharded_state_bytes(sharded: ShardedCollectives, compute_bytes: float) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes on one rank: the 16 bytes per parameter over the shard group (fp32 shard
    4, its fp32 gradient 4, Adam 8), plus what is gathered at once: the chunk's unit and two layers of parameters
    in the gather dtype, one layer's unsharded gradient (compute dtype) and its reduce-scatter buffer."""
    shard = sharded.params_per_shard
    layer = float(sum(p.padded_numel(sharded.shards) for p in sharded.layers[0]))
    root = float(sum(p.padded_numel(sharded.shards) for p in sharded.root))
    live = 2 * layer  # FSDP2: the layer computing and the one prefetched
    if sharded.software.gather_per_param:  # per parameter: the one in use and the prefetch budget
        largest = max(float(p.padded_numel(sharded.shards)) for p in sharded.layers[0])
        live = largest + min(layer, sharded.software.prefetch_params)
        layer = largest  # gradients too are reduced parameter by parameter
    gathered = (root + live) * sharded.gather_bytes
    unsharded_grads = layer * (compute_bytes + sharded.reduce_bytes)
    return 4.0 * shard + gathered, 4.0 * shard + unsharded_grads, 8.0 * shard
