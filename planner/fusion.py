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

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model.config import ModelConfig

# the three chains of §5.8, by the names ActivationShape.fused holds
BIAS_ACTIVATION = "bias_activation"
BIAS_DROPOUT_ADD = "bias_dropout_add"
SCALE_MASK_SOFTMAX = "scale_mask_softmax"
FUSIONS = frozenset((BIAS_ACTIVATION, BIAS_DROPOUT_ADD, SCALE_MASK_SOFTMAX))
FP32_BYTES = 4


def fused_operators(model: ModelConfig, attention: str) -> frozenset[str]:
    """The chains of FUSIONS that run fused for this model config on an attention path ("materialized" or
    "flash", the cluster's efficiency.attention)."""
    selection = model.kernel_selection()
    activation_kernel = "swiglu" if model.activation == "swiglu" else "bias_gelu"
    fused = set()
    if selection.uses(activation_kernel):
        fused.add(BIAS_ACTIVATION)
    if selection.uses("bias_dropout_add"):
        fused.add(BIAS_DROPOUT_ADD)
    if attention == "flash" or selection.names:
        fused.add(SCALE_MASK_SOFTMAX)
    return frozenset(fused)
