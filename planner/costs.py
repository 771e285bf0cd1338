"""Time of the pieces of one PTD-P iteration on one GPU, from FLOPs, bytes and the cluster's links.

- GEMMs: F FLOPs over R rows (tokens) take (F + gemm_half_flops) / (gemm_max * R / (R + half_rows) * peak):
  the efficiency rises with the GEMM's size (hidden size, micro-batch, 1/tp) and row count towards gemm_max.
- Memory-bound kernels (norms, bias + dropout + residual, GeLU/SwiGLU, the softmax and dropout of a
  materialised attention, the optimizer): bytes / (hbm * HBM bandwidth).
- Collectives (planner/collectives.py lists them; `collective_seconds_of` prices each) over a group of n GPUs
  with g per node: NCCL's ring, NVLink inside the node and each GPU's own
  network card between nodes; the slower of the two carries the time, plus the latency as NCCL's own cost
  model counts it (graph/tuning.cc): a base latency per call, and per ring step the network's latency for
  the steps that cross a node boundary, NVLink's for the others (tensor parallelism beyond a node pays both).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.config import ModelConfig
from model.shape import attention_matmul_flops, layer_gemm_flops, moe_gemms, output_gemm
from parallel.rank_grid import MEGATRON_ORDER, RankGrid
from planner.activations import ActivationShape
from planner.cluster import ClusterSpec
from planner.collectives import ActionCollectives, Collective
from planner.experts import ExpertLayout, all_to_all_seconds
from planner.fusion import BIAS_ACTIVATION, BIAS_DROPOUT_ADD, FP32_BYTES, SCALE_MASK_SOFTMAX

# the dimensions each named group spans (parallel/state.py names them; "embedding" joins two pipeline ends)
GROUP_DIMS = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "dp_cp": ("dp", "cp"),
    "pp": ("pp",),
    "tp_pp": ("tp", "pp"),
    "world": MEGATRON_ORDER,
    "embedding": ("pp",),
    "ep": ("ep",),  # expert parallelism's groups live in the experts' grid (planner/experts.expert_grid)
    "expert_dp": ("expert_dp",),
}
EXPERT_GROUPS = ("ep", "expert_dp")


@dataclass(frozen=True)
class Hardware:
    """The cluster seen by one run: peak for its precision, the spec, and where the run's ranks sit (the rank
    grid of its layout, nodes holding `gpus_per_node` consecutive ranks)."""

    cluster: ClusterSpec
    fp32: bool
    grid: RankGrid
    experts: RankGrid | None = None  # the experts' view of the same ranks (tp, ep, expert_dp, pp), MoE only
    _per_node: dict[tuple[str, ...], int] = field(default_factory=dict, compare=False, repr=False)
    _crosses: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)

    def per_node(self, *dims: str) -> int:
        """Members of a group along `dims` ("tp"; "dp", "cp" for the gradient reduction) that share a node."""
        if dims not in self._per_node:  # walks every group of the grid: once per run
            grid = self.experts if self.experts is not None and dims[0] in EXPERT_GROUPS else self.grid
            self._per_node[dims] = grid.per_node(self.cluster.gpus_per_node, *dims)
        return self._per_node[dims]

    def crosses_nodes(self, dim: str) -> bool:
        """Whether some `dim` group (e.g. a pipeline) spans two nodes."""
        if dim not in self._crosses:
            self._crosses[dim] = self.grid.crosses_nodes(dim, self.cluster.gpus_per_node)
        return self._crosses[dim]

    @property
    def device_share(self) -> float:
        """The part of a device one rank gets: 1 on GPUs; on a CPU node whose `cores` are shared by more
        single-threaded busy processes (the ranks plus `competing_processes`), cores / processes: the
        scheduler's fair share."""
        cores = self.cluster.cores_per_node
        ranks = min(self.grid.world_size, self.cluster.gpus_per_node)
        return 1.0 if cores <= 0 else min(1.0, cores / (ranks + self.cluster.efficiency.competing_processes))

    @property
    def peak_flops(self) -> float:
        peak = self.cluster.peak_tflops_fp32 if self.fp32 else self.cluster.peak_tflops
        return 1e12 * peak * self.device_share

    def gemm_seconds(self, flops: float, rows: float) -> float:
        """One GEMM (or batched GEMM) of `flops` over `rows` rows on the efficiency curve."""
        eff = self.cluster.efficiency
        row_share = rows / (rows + eff.gemm_half_rows)
        return (flops + eff.gemm_half_flops) / (eff.gemm_max * row_share * self.peak_flops)

    def memory_seconds(self, nbytes: float) -> float:
        """A memory-bound kernel moving `nbytes` through HBM."""
        return nbytes / (self.cluster.efficiency.hbm * self.cluster.hbm_gbs * 1e9 * self.device_share)

    def link_seconds(self, nbytes: float, inter_node: bool) -> float:
        """One point-to-point transfer from this GPU."""
        if nbytes <= 0:
            return 0.0
        spec, eff = self.cluster, self.cluster.efficiency
        rate = spec.network_gbs_per_gpu * eff.network if inter_node else spec.nvlink_one_way_gbs * eff.nvlink
        hop = eff.latency_us if inter_node else eff.nvlink_latency_us
        latency = eff.collective_base_us + hop  # one call, one hop
        return nbytes / (rate * 1e9) + latency * 1e-6

    def collective_seconds(self, kind: str, nbytes: float, group_size: int, per_node: int) -> float:
        """all_reduce, reduce_scatter or all_gather of `nbytes` (the full buffer) over `group_size` GPUs,
        `per_node` of them in each node."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        spec, eff = self.cluster, self.cluster.efficiency
        factor = 2.0 if kind == "all_reduce" else 1.0
        n = group_size
        g = max(1, min(per_node, n))
        k = n // g
        # NCCL's ring: every GPU moves factor (n-1)/n of the buffer over NVLink; across nodes, the rings (one
        # per network card, g of them) each cross every node boundary carrying factor (n-1)/n / g of it.
        share = factor * (n - 1) / n * nbytes
        intra = share / (spec.nvlink_one_way_gbs * eff.nvlink * 1e9) if g > 1 else 0.0
        inter = share / g / (spec.network_gbs_per_gpu * eff.network * 1e9) if k > 1 else 0.0
        # a ring all-reduce takes 2 (n - 1) steps (reduce-scatter, all-gather: n - 1), of which the ring crosses
        # the k nodes' boundaries 2 (k - 1) times
        steps, inter_steps = factor * (n - 1), factor * (k - 1)
        latency = eff.collective_base_us + inter_steps * eff.latency_us + (steps - inter_steps) * eff.nvlink_latency_us
        return max(intra, inter) + latency * 1e-6


@dataclass(frozen=True)
class LayerTimes:
    """Compute seconds of one transformer layer for one micro-batch on one GPU (its collectives:
    planner/collectives.py, priced by `action_comm_seconds`)."""

    forward: float
    backward: float  # recomputation included
    recompute: float  # the part of `backward` that re-runs the forward
    weight_grad: float = 0.0  # the part of `backward` only the weights need (their GEMMs): zb's WEIGHT action
    core: float = 0.0  # the forward of the core attention (what ring attention's transfers overlap)


def core_attention_seconds(shape: ActivationShape, model: ModelConfig, hw: Hardware) -> float:
    """Forward of softmax(q k^T) v: two batched GEMMs plus, when materialised, softmax and dropout in HBM."""
    # q: this rank's queries (s/cp under context parallelism, load-balanced: 1/cp of the causal work) against
    # all s keys
    s, q, b, t = shape.seq_length, shape.local_seq, shape.micro_batch, shape.tp_size
    flops = attention_matmul_flops(model, q * b, s, t)  # each of q k^T and (scores) v
    if hw.cluster.efficiency.attention == "flash":
        return 2 * hw.gemm_seconds(flops, q * b)
    scores = shape.heads * q * s * b / t
    vb = shape.value_bytes
    softmax = 2 * vb * scores  # read scores, write probabilities (scale + mask + softmax fused)
    dropout = (2 * vb + shape.mask_bytes) * scores if shape.attention_dropout else 0.0
    qk = max(hw.gemm_seconds(flops, q * b), hw.memory_seconds(vb * scores))  # writes the scores
    pv = max(hw.gemm_seconds(flops, q * b), hw.memory_seconds(vb * scores))  # reads the probabilities
    return qk + pv + hw.memory_seconds(softmax + dropout)


def elementwise_bytes(shape: ActivationShape) -> float:
    """HBM bytes of the fused memory-bound kernels of one layer's forward (norms, bias+dropout+residual,
    GeLU/SwiGLU); the norms and residual work on the full [s, b, h] unless sequence parallel."""
    sbh = shape.local_seq * shape.micro_batch * shape.hidden
    vb, mask = shape.value_bytes, (shape.mask_bytes if shape.hidden_dropout else 0)
    split = shape.tp_size if shape.sequence_parallel else 1
    norms = 2 * (2 * vb * sbh)  # read x, write norm(x)
    residual = 2 * ((3 * vb + mask) * sbh)  # read y and x, write x + drop(y), write mask
    ffn_tokens = shape.local_seq * shape.micro_batch * shape.ffn / shape.tp_size
    activation = (3 if shape.swiglu else 2) * vb * ffn_tokens
    return (norms + residual) / split + activation


def layer_times(shape: ActivationShape, model: ModelConfig, hw: Hardware, recompute: str) -> LayerTimes:
    """Forward, backward (2x the GEMMs: input and weight gradients) and recomputation of one layer, on this
    rank's tokens (s/cp under context parallelism), plus the HBM traffic of the chains the config leaves
    unfused (planner/fusion.py), forward and backward counted separately."""
    rows = shape.local_seq * shape.micro_batch
    gemm = sum(hw.gemm_seconds(f, rows) for f in layer_gemm_flops(model, rows, shape.tp_size))
    unfused = unfused_bytes(shape, model.add_bias_linear)
    fused_core = core_attention_seconds(shape, model, hw)
    fused_forward = gemm + fused_core + hw.memory_seconds(elementwise_bytes(shape))
    core = fused_core + hw.memory_seconds(unfused.softmax_forward)
    forward = fused_forward + hw.memory_seconds(unfused.elementwise_forward + unfused.softmax_forward)
    backward = 2 * fused_forward + hw.memory_seconds(unfused.elementwise_backward + unfused.softmax_backward)
    recomputed = forward if recompute == "full" else core if recompute == "selective" else 0.0
    return LayerTimes(forward, backward + recomputed, recomputed, weight_grad=gemm, core=core)


def moe_layer_times(
    shape: ActivationShape, model: ModelConfig, hw: Hardware, recompute: str, experts: ExpertLayout
) -> LayerTimes:
    """An MoE layer: `layer_times` of the dense layer with its MLP (fc1, fc2 and their activation) replaced by
    the router, the rank's routed experts as one grouped GEMM per projection, the shared expert, the activation
    and the permute / unpermute copies. The rank routes its tokens (1/tp with sequence parallelism, all of them
    otherwise: replicated work); balanced routing brings it as many expert rows as it sends (P = tokens x top_k),
    spread over its E / ep experts, which sets the grouped GEMMs' rows per expert."""
    dense = layer_times(shape, model, hw, recompute)
    rows = shape.local_seq * shape.micro_batch
    vb, gated = shape.value_bytes, model.activation == "swiglu"
    dense_fc1, dense_fc2 = layer_gemm_flops(model, rows, shape.tp_size)[2:]
    dense_mlp = hw.gemm_seconds(dense_fc1, rows) + hw.gemm_seconds(dense_fc2, rows)
    dense_mlp += hw.memory_seconds((3 if gated else 2) * vb * rows * shape.ffn / shape.tp_size)
    routed = experts.routed_tokens(rows)
    expert_rows = routed * model.moe_router_topk
    per_expert = expert_rows / experts.local_experts
    h, f = model.hidden_size, model.moe_ffn_size
    moe = 0.0
    # model/shape.moe_gemms with one routed expert: each grouped GEMM runs the rank's P rows through its E / ep
    # experts of that shape; the router and the shared expert (and its gate) see every routed token
    for gemm in moe_gemms(model, 1):
        if gemm.name.startswith("experts."):
            moe += hw.gemm_seconds(2.0 * expert_rows * gemm.weights, per_expert)
        else:
            moe += hw.gemm_seconds(2.0 * routed * gemm.weights, routed)
    shared = model.moe_shared_expert_ffn_hidden_size or 0
    # activation over [P, f] (gated: read 2f, write f), permute (read [T, h], write [P, h]) and the weighted
    # unpermute (read [P, h], write [T, h]), the shared expert's activation
    moe += hw.memory_seconds((3 if gated else 2) * vb * (expert_rows * f + routed * shared))
    moe += hw.memory_seconds(2 * vb * h * (routed + expert_rows))
    delta = moe - dense_mlp  # the weight gradients' share changes by as much as the forward's
    again = delta if recompute == "full" else 0.0
    return LayerTimes(
        dense.forward + delta,
        dense.backward + 2 * delta + again,
        dense.recompute + again,
        weight_grad=dense.weight_grad + delta,
        core=dense.core,
    )


def collective_seconds_of(hw: Hardware, collective: Collective) -> float:
    """One listed collective: a send or a receive as one link transfer (across nodes when its group spans
    two), every other kind as NCCL's ring over its group."""
    dims = GROUP_DIMS[collective.group]
    if collective.kind in ("send", "recv"):
        return hw.link_seconds(collective.nbytes, hw.crosses_nodes(dims[0]))
    if collective.kind == "all_to_all":
        spec, eff = hw.cluster, hw.cluster.efficiency
        return all_to_all_seconds(
            collective.nbytes,
            collective.group_size,
            hw.per_node(*dims),
            spec.nvlink_one_way_gbs * eff.nvlink,
            spec.network_gbs_per_gpu * eff.network,
            eff.collective_base_us,
            eff.nvlink_latency_us,
            eff.latency_us,
        )
    per_node = 1 if collective.group == "embedding" else hw.per_node(*dims)  # the two ends of a pipeline
    return hw.collective_seconds(collective.kind, collective.nbytes, collective.group_size, per_node)


def action_comm_seconds(hw: Hardware, action: ActionCollectives, block_seconds: float) -> float:
    """The exposed communication of one action: its tp collectives in full, and each of ring attention's
    sends only beyond the block attention it overlaps (`block_seconds`: a forward block, 1/cp of the core
    attention; backward blocks take twice that); a receive is the same transfer as its peer's send."""
    tp = sum(collective_seconds_of(hw, c) for c in action.tp)
    ring = [(c, block_seconds) for c in action.ring_forward] + [(c, 2 * block_seconds) for c in action.ring_backward]
    exposed = sum(max(0.0, collective_seconds_of(hw, c) - block) for c, block in ring if c.kind == "send")
    return tp + exposed


def step_seconds(hw: Hardware, collectives: tuple[Collective, ...]) -> float:
    """One batch of pipeline messages (planner/collectives.LayoutCollectives.step): its transfers run together,
    the slowest sets the time; each scattered receive is then all-gathered over tp (paper section 4.1)."""
    transfers = [collective_seconds_of(hw, c) for c in collectives if c.kind in ("send", "recv")]
    gathers = sum(collective_seconds_of(hw, c) for c in collectives if c.kind not in ("send", "recv"))
    return max(transfers, default=0.0) + gathers


def head_times(shape: ActivationShape, model: ModelConfig, hw: Hardware, padded_vocab: int) -> tuple[float, float]:
    """(forward, backward) seconds of final norm + output layer + vocab-parallel cross entropy."""
    tokens = shape.local_seq * shape.micro_batch
    flops = 2.0 * tokens * output_gemm(model, padded_vocab).weights / shape.tp_size
    logits = 4.0 * tokens * padded_vocab / shape.tp_size  # fp32 logits
    forward = hw.gemm_seconds(flops, tokens) + hw.memory_seconds(
        3 * logits + 4 * shape.value_bytes * tokens * shape.hidden
    )
    backward = 2 * hw.gemm_seconds(flops, tokens) + hw.memory_seconds(2 * logits)
    return forward, backward


def optimizer_seconds(
    params_local: int, dp_size: int, distributed: bool, hw: Hardware, step_bytes: float = 28.0, copy_bytes: float = 6.0
) -> float:
    """The optimizer step, memory-bound: `step_bytes` per element of the rank's shard (AdamW on the fp32
    masters: read grad, master, moments; write master, moments: 28 B) plus `copy_bytes` per local parameter
    (the grad-norm read and the 16-bit copy-back: 6 B)."""
    shard = params_local / dp_size if distributed else params_local
    return hw.memory_seconds(step_bytes * shard + copy_bytes * params_local)


@dataclass(frozen=True)
class UnfusedBytes:
    """HBM bytes the unfused chains add to one layer and micro-batch on one GPU (0 for a fused chain)."""

    elementwise_forward: float = 0.0  # bias + activation, the two bias + dropout + add
    elementwise_backward: float = 0.0
    softmax_forward: float = 0.0  # scale + mask + softmax over the [b, a/t, s, s] scores
    softmax_backward: float = 0.0


def unfused_bytes(shape: ActivationShape, add_bias: bool) -> UnfusedBytes:
    """Extra HBM bytes of the chains `shape.fused` leaves unfused, per layer and micro-batch (v: the value size).

    bias + GeLU, forward: unfused `y + b` (read y, write: 2v) then GeLU (read, write: 2v), fused one kernel
    (2v): +2v per ffn element when there is a bias. Backward: GeLU's backward reads grad and input and writes
    (3v) in both; the bias add passes its gradient through: +0.
    bias + SwiGLU on [tokens, 2f]: unfused bias add (read, write 2f: 4v f), silu(gate) (2v f), silu * up
    (read 2f, write f: 3v f) against the fused read 2f, write f (3v f): +(4 if bias) v f + 2v f; backward:
    the product's (read grad, silu, up; write two grads: 5v f) and silu's (read grad, gate; write: 3v f)
    against the fused read grad, y, write 2f (5v f): +3v f.
    bias + dropout + add, twice per layer on [s, b, h] (over tp with sequence parallelism): unfused bias add
    (2v), dropout (read, write, write the mask: 2v + mask), residual add (read two, write: 3v), fused 3v + mask:
    +2v for the bias and +2v for the dropout. Backward: dropout's (read grad and mask, write) in both: +0.
    scale + mask + softmax on the scores: Megatron-LM 2021's unfused path upcasts to fp32 (its softmax runs in
    fp32 whenever query-key layer scaling is on, the default) and runs cast (v + 4), scale (8), masked fill (8;
    the [s, s] mask is broadcast over heads and batch, ignored), softmax (8) and the cast back (4 + v): 32 + 2v,
    against the fused read v, write v: +32 B per score at v = 2. Backward: the casts (v + 4 each), softmax's (read grad
    and output, write: 12), the fill's and the scale's (8 each): 36 + 2v against the fused 3v (+34 B at v = 2). In fp32 runs
    there are no casts: 24 against 8 forward, 28 against 12 backward.
    """
    v = shape.value_bytes
    tokens = shape.local_seq * shape.micro_batch
    fwd = bwd = 0.0
    if BIAS_ACTIVATION not in shape.fused:
        ffn = tokens * shape.ffn / shape.tp_size
        if shape.swiglu:
            fwd += ((4 if add_bias else 0) * v + 2 * v) * ffn
            bwd += 3 * v * ffn
        elif add_bias:
            fwd += 2 * v * ffn
    if BIAS_DROPOUT_ADD not in shape.fused:
        split = shape.tp_size if shape.sequence_parallel else 1
        per_element = (2 * v if add_bias else 0) + (2 * v if shape.hidden_dropout else 0)
        fwd += 2 * per_element * tokens * shape.hidden / split
    softmax_fwd = softmax_bwd = 0.0
    if SCALE_MASK_SOFTMAX not in shape.fused and shape.attention_kept == "materialized":
        scores = shape.heads * shape.local_seq * shape.seq_length * shape.micro_batch / shape.tp_size
        casts = 2 * (v + FP32_BYTES) if v < FP32_BYTES else 0
        softmax_fwd = (casts + 3 * 2 * FP32_BYTES - 2 * v) * scores
        softmax_bwd = (casts + 3 * FP32_BYTES + 2 * 2 * FP32_BYTES - 3 * v) * scores
    return UnfusedBytes(fwd, bwd, softmax_fwd, softmax_bwd)
