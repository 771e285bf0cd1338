"""Operator fusion (the paper's §4.2 and §5.8): which of a layer's memory-bound chains run as one kernel, and the
HBM traffic the unfused chains add.

The paper fuses three chains: bias + GeLU, bias + dropout + residual add, and scale + mask + softmax. A fused
chain reads its inputs once and writes its output once; unfused, every op of the chain reads its input from HBM
and writes its result back, so the intermediate tensors cross HBM once more per op. The cost model
(planner/costs.py) charges the fused kernels; `unfused_bytes` gives the extra bytes per layer and micro-batch,
forward and backward, which costs.layer_times charges at the cluster's HBM bandwidth. Nothing is fitted: the
counts follow the ops of each chain (listed below per chain), with the value size of the run.

Which chains are fused comes from the config's kernel selection (model/kernels: `model.fused_kernels`,
`model.fused_kernel_names`): bias_gelu (or swiglu for a SwiGLU model) fuses the activation chain,
bias_dropout_add the residual chain. The trainer's attention is torch's scaled_dot_product_attention, whose
fused kernels (flash on GPUs: efficiency.attention "flash") always fuse scale, mask and softmax; the
materialised attention models Megatron-LM 2021, whose masked-softmax fusion was switched together with its other
fusions, so there it follows `model.fused_kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from model.kernels import KernelSelection

if TYPE_CHECKING:
    from model.config import ModelConfig
    from planner.activations import ActivationShape

# the three chains of §5.8, by the names ActivationShape.fused holds
BIAS_ACTIVATION = "bias_activation"
BIAS_DROPOUT_ADD = "bias_dropout_add"
SCALE_MASK_SOFTMAX = "scale_mask_softmax"
FUSIONS = frozenset((BIAS_ACTIVATION, BIAS_DROPOUT_ADD, SCALE_MASK_SOFTMAX))
FP32_BYTES = 4


def fused_operators(model: ModelConfig, attention: str) -> frozenset[str]:
    """The chains of FUSIONS that run fused for this model config on an attention path ("materialized" or
    "flash", the cluster's efficiency.attention)."""
    selection = KernelSelection.from_model_config(model)
    activation_kernel = "swiglu" if model.activation == "swiglu" else "bias_gelu"
    fused = set()
    if selection.uses(activation_kernel):
        fused.add(BIAS_ACTIVATION)
    if selection.uses("bias_dropout_add"):
        fused.add(BIAS_DROPOUT_ADD)
    if attention == "flash" or selection.names:
        fused.add(SCALE_MASK_SOFTMAX)
    return frozenset(fused)


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
