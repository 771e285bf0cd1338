"""Fused operations of the GPT and the switch that picks them.

Each fused op has a plain-torch reference of identical semantics (model/kernels/reference.py) and runs in
Triton where Triton runs (CUDA; CPU only under TRITON_INTERPRET=1). The model calls the dispatch functions
below at its norm, MLP activation, rotary, bias-dropout-add and loss sites; with a kernel off they run the
model's original code, so the default configuration computes exactly what it computed before.

    name                  replaces                                        Triton kernels
    norm                  nn.LayerNorm / nn.RMSNorm                       norm_fwd, norm_bwd
    bias_gelu             fc1 bias + F.gelu                               bias_gelu_fwd/_bwd
    swiglu                fc1 bias + silu(gate) * up                      bias_swiglu_fwd/_bwd
    bias_dropout_add      residual + dropout(y + bias)                    bias_dropout_add_fwd, mul_fwd
    rotary                rotate-half rope on q and k                     rotary_kernel
    linear_cross_entropy  output layer + (vocab-parallel) cross entropy   ce_chunk_stats, ce_chunk_grad
                          chunked over tokens (torch chunks without Triton)
    grouped_mm            the MoE experts' per-group matrix multiplies    grouped_mm (forward, dX, dW)
                          (torch's grouped_mm or a per-expert loop)

Selection: `model.fused_kernels=true` turns every kernel on; `model.fused_kernel_names=[norm, rotary]` then
keeps only those. `ModelConfig.kernel_selection()` reads those keys (`KernelSelection.of`); once per model build
(model/rank_spec.py, parallel/model_builder.py) its `registered()` registers the custom ops it needs (model/kernels/registry.py: an explicit, idempotent call; importing this
package registers nothing); every module of the model holds that one selection.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from model.kernels import reference
from model.kernels.backend import backend_name, triton_installed, triton_runs
from model.kernels.cross_entropy import CrossEntropyReductions, chunked_linear_cross_entropy
from model.kernels.registry import KernelOps, register_kernel_ops

KERNEL_NAMES = ("norm", "bias_gelu", "swiglu", "bias_dropout_add", "rotary", "linear_cross_entropy", "grouped_mm")


@dataclass(frozen=True)
class KernelSelection:
    """Which fused kernels the model uses (empty: none, the default), and their registered ops (None until
    `registered()`: a model build does both, from `ModelConfig.kernel_selection()`)."""

    names: frozenset[str] = frozenset()
    ops: KernelOps | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, fused_kernels: bool, names: Sequence[str] | None) -> KernelSelection:
        """From model.fused_kernels (all on/off) and model.fused_kernel_names (a subset, or None = all)."""
        if not fused_kernels:
            return cls()
        return cls(frozenset(KERNEL_NAMES if names is None else names))

    def registered(self) -> KernelSelection:
        """This selection with its custom ops registered; nothing to register when no kernel is selected or
        Triton is not installed (every op then takes its torch path)."""
        if not self.names or not triton_installed() or self.ops is not None:
            return self
        return replace(self, ops=register_kernel_ops())

    def fused_ops(self) -> KernelOps:
        """The registered ops (called only where a selected kernel runs in Triton)."""
        if self.ops is None:
            raise RuntimeError(
                "fused kernels are selected but their ops were never registered: build the model from a RankSpec "
                "(model/rank_spec.py) or call KernelSelection.registered()"
            )
        return self.ops

    def uses(self, name: str) -> bool:
        return name in self.names

    def describe(self, device: torch.device | str) -> str:
        """One line for the log: which kernels run, and on which path."""
        if not self.names:
            return "fused kernels: off"
        path = backend_name(device)
        chosen = ", ".join(name for name in KERNEL_NAMES if name in self.names)
        if path == "torch":
            return (
                f"fused kernels: {chosen} on the torch path (no Triton for {torch.device(device).type}; "
                f"set TRITON_INTERPRET=1 to run the kernels on CPU): references, chunked cross entropy"
            )
        return f"fused kernels: {chosen} via {path}"


def norm(module: nn.Module, x: torch.Tensor, kernels: KernelSelection) -> torch.Tensor:
    """module(x) for an nn.LayerNorm / nn.RMSNorm, fused when selected and Triton runs."""
    if not (kernels.uses("norm") and triton_runs(x.device)):
        return module(x)
    is_rms = isinstance(module, nn.RMSNorm)
    eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
    weight, bias = cast(torch.Tensor, module.weight), None if is_rms else cast(torch.Tensor | None, module.bias)
    return kernels.fused_ops().norm(x, weight, bias, float(cast(float, eps)), is_rms)


def linear_skip_bias(linear: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """linear(x) without its bias, and the bias: nn.Linear, or a layer whose forward takes skip_bias_add
    (the tensor-parallel linears of parallel/tp_layers.py)."""
    if isinstance(linear, nn.Linear):
        return F.linear(x, linear.weight), linear.bias
    return linear(x, skip_bias_add=True)


def linear_activation(
    fc1: nn.Module, x: torch.Tensor, swiglu: bool, kernels: KernelSelection, gelu_approximate: str = "none"
) -> torch.Tensor:
    """The MLP's first half: gelu(fc1(x)) or silu(gate) * up of fc1(x) = [gate, up]. gelu_approximate="tanh"
    is GPT-2's tanh GeLU, which the fused bias_gelu kernel (exact erf) does not compute: it takes the
    reference path."""
    name = "swiglu" if swiglu else "bias_gelu"
    if gelu_approximate != "none":
        return reference.bias_gelu(fc1(x), None, gelu_approximate)
    if not kernels.uses(name):
        return (reference.bias_swiglu if swiglu else reference.bias_gelu)(fc1(x), None)
    y, bias = linear_skip_bias(fc1, x)
    if not triton_runs(y.device):
        return (reference.bias_swiglu if swiglu else reference.bias_gelu)(y, bias)
    ops = kernels.fused_ops()
    return (ops.bias_swiglu if swiglu else ops.bias_gelu)(y, bias)


def bias_dropout_add(
    y: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    dropout: Callable[[torch.Tensor], torch.Tensor],
    dropout_p: float,
    training: bool,
    kernels: KernelSelection,
) -> torch.Tensor:
    """residual + dropout(y + bias). Fused, the mask is `dropout(ones)`: drawn by the same module (so from the
    same RNG stream, e.g. the tensor-parallel tracker's fork) and the same generator calls as dropout(y + bias),
    hence the same mask; the kernel then adds bias, applies the mask and adds the residual in one pass."""
    if not fuses_bias_dropout_add(kernels, y.device):
        return reference.bias_dropout_add(y, bias, residual, dropout)
    scaled_mask = dropout(torch.ones_like(y)) if training and dropout_p > 0 else None
    return kernels.fused_ops().bias_dropout_add(y, bias, residual, scaled_mask)


def fuses_bias_dropout_add(kernels: KernelSelection, device: torch.device) -> bool:
    """Whether bias_dropout_add runs fused on `device` (then callers hand it the bias separately)."""
    return kernels.uses("bias_dropout_add") and triton_runs(device)


def rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: KernelSelection
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [s, b, nq, d] and k [s, b, nkv, d] rotated by cos, sin [s, b, 1, d]."""
    if not (kernels.uses("rotary") and triton_runs(q.device)):
        return reference.apply_rotary(q, cos, sin), reference.apply_rotary(k, cos, sin)
    return kernels.fused_ops().rotary_qk(q, k, cos, sin)


def fuses_grouped_mm(kernels: KernelSelection, device: torch.device) -> bool:
    """Whether the experts' grouped matrix multiply runs as the Triton kernel on `device` (else the experts
    choose between torch's grouped_mm and the per-expert loop: model/moe/experts.py)."""
    return kernels.uses("grouped_mm") and triton_runs(device)


def fused_grouped_mm(
    x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: torch.Tensor, kernels: KernelSelection
) -> torch.Tensor:
    """x [P, K] in E consecutive groups of tokens_per_expert [E] rows, weights [E, N, K] -> [P, N], group e
    times weights[e].T, by the Triton kernel (reference: `reference.grouped_mm`). The counts stay on the device:
    the kernel finds each program's group from their cumulative sum, so no host sync."""
    if x.dtype != weights.dtype:
        raise ValueError(f"grouped_mm: x is {x.dtype} but the weights are {weights.dtype}")
    group_ends = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    return kernels.fused_ops().grouped_mm(x, weights, group_ends)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    num_valid: int,
    reductions: CrossEntropyReductions,
) -> torch.Tensor:
    """Per-token loss [s, b] of hidden [s, b, h] through the output layer weight [V_local, h], chunked."""
    return _chunked_loss_eager()(
        hidden, weight, labels, vocab_start, num_valid, reductions, use_triton=triton_runs(hidden.device)
    )


@functools.cache
def _chunked_loss_eager() -> Callable[..., torch.Tensor]:
    """chunked_linear_cross_entropy run eagerly even inside a compiled region (a Python loop over chunks with
    injected collectives). Built at first use: torch.compiler.disable imports torch._dynamo (~1 CPU s), which a
    process that never computes this loss (a tool, the planner) need not pay."""
    return torch.compiler.disable(chunked_linear_cross_entropy)


__all__ = [
    "KERNEL_NAMES",
    "CrossEntropyReductions",
    "KernelOps",
    "KernelSelection",
    "bias_dropout_add",
    "fused_grouped_mm",
    "fused_linear_cross_entropy",
    "fuses_bias_dropout_add",
    "fuses_grouped_mm",
    "linear_activation",
    "linear_skip_bias",
    "norm",
    "rotary_qk",
]
