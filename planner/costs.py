"""Time of the pieces of one PTD-P iteration on one GPU, from FLOPs, bytes and the cluster's links.

- GEMMs: F FLOPs over R rows (tokens) take (F + gemm_half_flops) / (gemm_max * R / (R + half_rows) * peak):
  the efficiency rises with the GEMM's size (hidden size, micro-batch, 1/tp) and row count towards gemm_max.
- Memory-bound kernels (norms, bias + dropout + residual, GeLU/SwiGLU, the softmax and dropout of a
  materialised attention, the optimizer): bytes / (hbm * HBM bandwidth).
- Collectives over a group of n GPUs with g per node: NCCL's ring, NVLink inside the node and each GPU's own
  network card between nodes; the slower of the two carries the time, plus the latency as NCCL's own cost
  model counts it (graph/tuning.cc): a base latency per call, and per ring step the network's latency for
  the steps that cross a node boundary, NVLink's for the others (tensor parallelism beyond a node pays both).
"""

from __future__ import annotations

from dataclasses import dataclass

from model.config import ModelConfig
from model.shape import attention_matmul_flops, layer_gemm_flops, output_gemm
from parallel.rank_grid import RankGrid
from planner.activations import ActivationShape
from planner.cluster import ClusterSpec
from planner.ring import exposed_ring_seconds, kv_block_bytes


@dataclass(frozen=True)
class Hardware:
    """The cluster seen by one run: peak for its precision, the spec, and where the run's ranks sit (the rank
    grid of its layout, nodes holding `gpus_per_node` consecutive ranks)."""

    cluster: ClusterSpec
    fp32: bool
    grid: RankGrid

    def per_node(self, *dims: str) -> int:
        """Members of a group along `dims` ("tp"; "dp", "cp" for the gradient reduction) that share a node."""
        return self.grid.per_node(self.cluster.gpus_per_node, *dims)

    def crosses_nodes(self, dim: str) -> bool:
        """Whether some `dim` group (e.g. a pipeline) spans two nodes."""
        return self.grid.crosses_nodes(dim, self.cluster.gpus_per_node)

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
    """Seconds of one transformer layer for one micro-batch on one GPU."""

    forward: float  # compute
    backward: float  # compute, recomputation included
    recompute: float  # the part of `backward` that re-runs the forward
    tp_forward: float  # tensor-parallel collectives
    tp_backward: float
    weight_grad: float = 0.0  # the part of `backward` only the weights need (their GEMMs): zb's WEIGHT action


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
    rank's tokens (s/cp under context parallelism). The tp_* times hold the layer's exposed communication: tp's
    collectives and, under cp, what the ring's key/value transfers take beyond the block attention they
    overlap (planner/ring.py)."""
    rows = shape.local_seq * shape.micro_batch
    gemm = sum(hw.gemm_seconds(f, rows) for f in layer_gemm_flops(model, rows, shape.tp_size))
    core = core_attention_seconds(shape, model, hw)
    other = hw.memory_seconds(elementwise_bytes(shape))
    forward = gemm + core + other
    backward = 2 * forward
    recomputed = forward if recompute == "full" else core if recompute == "selective" else 0.0
    # tp: 2 all-reduces (or all-gather + reduce-scatter pairs with sequence parallelism) each way
    t = shape.tp_size
    one = hw.collective_seconds(
        "all_reduce", shape.local_seq * shape.micro_batch * shape.hidden * shape.value_bytes, t, hw.per_node("tp")
    )
    ring_forward, ring_backward = ring_seconds(shape, model, hw, core)
    tp_forward = 2 * one + ring_forward
    tp_backward = 2 * one + ring_backward + (tp_forward if recompute == "full" else 0.0)
    return LayerTimes(forward, backward + recomputed, recomputed, tp_forward, tp_backward, weight_grad=gemm)


def ring_seconds(shape: ActivationShape, model: ModelConfig, hw: Hardware, core: float) -> tuple[float, float]:
    """(forward, backward) exposed time of context parallelism's ring in one layer: each key/value block
    transfer overlaps one block's attention (1/cp of the rank's core attention; backward twice that)."""
    cp = shape.cp_size
    if cp == 1:
        return 0.0, 0.0
    block = kv_block_bytes(model, shape.micro_batch, shape.tp_size, cp, shape.value_bytes)
    send = hw.link_seconds(block, hw.crosses_nodes("cp"))
    forward = exposed_ring_seconds(send, core / cp, cp - 1)
    backward = exposed_ring_seconds(send, 2 * core / cp, 2 * cp - 1)
    return forward, backward


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


def p2p_seconds(shape: ActivationShape, hw: Hardware, inter_node: bool, scatter_gather: bool) -> float:
    """Sending one activation (or its gradient) [s, b, h] to the next stage, synchronously.

    Sequence parallelism sends each rank's [s/t, b, h] shard. Scatter/gather (paper §4.1) sends 1/tp of the
    replicated tensor per rank and all-gathers it over NVLink on the receiving stage.
    """
    nbytes = shape.local_seq * shape.micro_batch * shape.hidden * shape.value_bytes
    t = shape.tp_size
    if shape.sequence_parallel:
        return hw.link_seconds(nbytes / t, inter_node)
    if scatter_gather and t > 1:
        gather = hw.collective_seconds("all_gather", nbytes, t, hw.per_node("tp"))
        return hw.link_seconds(nbytes / t, inter_node) + gather
    return hw.link_seconds(nbytes, inter_node)


def optimizer_seconds(
    params_local: int, dp_size: int, distributed: bool, hw: Hardware, step_bytes: float = 28.0, copy_bytes: float = 6.0
) -> float:
    """The optimizer step, memory-bound: `step_bytes` per element of the rank's shard (AdamW on the fp32
    masters: read grad, master, moments; write master, moments: 28 B) plus `copy_bytes` per local parameter
    (the grad-norm read and the 16-bit copy-back: 6 B)."""
    shard = params_local / dp_size if distributed else params_local
    return hw.memory_seconds(step_bytes * shard + copy_bytes * params_local)
