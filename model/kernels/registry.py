"""The fused kernels as torch custom operators, registered by one explicit call: `register_kernel_ops()`.

It defines each launch of model/kernels/ops.py as the op gpt_kernels::<name>, gives it a fake (meta)
implementation (torch.compile traces with it: output shapes and dtypes only) and, for the forward ops, an
autograd formula whose backward calls the ops' own backward kernels (ops too, so the backward graph AOTAutograd
traces holds no graph break either). The formulas are those of the autograd.Functions they replaced, in the
same order, so eager numbers are bitwise unchanged. It returns the ops as a `KernelOps`.

Nothing is registered on import. The model's builder calls it once per process (model/kernels
`KernelSelection.registered`, from RankSpec); it is idempotent: an op already in torch's registry (the process-wide one
torch keeps) is looked up, not registered again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor
from torch.library import CustomOpDef

from model.kernels import ops

OP_NAMESPACE = "gpt_kernels"
if TYPE_CHECKING:  # OpOverload is generic in the type stubs; its aliases are for annotations only
    from torch.library import OpOverload

    # The registered operators, each callable like the launch of model/kernels/ops.py it wraps
    BiasActivationOp = OpOverload[[Tensor, Tensor | None], Tensor]  # (y, bias) -> act(y + bias)
    BiasActivationBwdOp = OpOverload[[Tensor, Tensor, Tensor | None], Tensor]  # (grad, y, bias) -> grad_y
    BiasDropoutAddOp = OpOverload[[Tensor, Tensor | None, Tensor, Tensor | None], Tensor]  # (y, bias, residual, mask)
    MulOp = OpOverload[[Tensor, Tensor], Tensor]
    NormFwdOp = OpOverload[[Tensor, Tensor, Tensor | None, float, bool], tuple[Tensor, Tensor, Tensor]]
    NormBwdOp = OpOverload[[Tensor, Tensor, Tensor, Tensor, Tensor, bool, bool], tuple[Tensor, Tensor, Tensor]]
    RotateOp = OpOverload[[Tensor, Tensor, Tensor, bool], Tensor]  # (x, cos2d, sin2d, backward)
    GroupedMMOp = OpOverload[[Tensor, Tensor, Tensor], Tensor]  # (x, weights, group_ends) -> [P, N]
    GroupedMMWeightGradOp = OpOverload[[Tensor, Tensor, Tensor], Tensor]  # (grad, x, group_ends) -> [E, N, K]


@dataclass(frozen=True)
class KernelOps:
    """The registered ops (call them like the launches of model/kernels/ops.py) and the two entry points the
    dispatch functions of model/kernels/__init__.py use besides them."""

    bias_gelu: BiasActivationOp
    bias_gelu_bwd: BiasActivationBwdOp
    bias_swiglu: BiasActivationOp
    bias_swiglu_bwd: BiasActivationBwdOp
    bias_dropout_add: BiasDropoutAddOp
    mul: MulOp
    norm_fwd: NormFwdOp
    norm_bwd: NormBwdOp
    rotate: RotateOp
    grouped_mm: GroupedMMOp
    grouped_mm_weight_grad: GroupedMMWeightGradOp

    def custom_ops(self) -> tuple[OpOverload, ...]:
        """Every op, for opcheck and the graph-break test."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def norm(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, is_rms: bool
    ) -> torch.Tensor:
        """LayerNorm (with or without bias) or RMSNorm of x [..., h] over the last dim."""
        y, _, _ = self.norm_fwd(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias, eps, is_rms)
        return y.view(x.shape)

    def rotary_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [s, b, nq, d] and k [s, b, nkv, d] rotated by cos, sin [s, b, 1, d] (no gradient to the angles)."""
        s, b, _, dim = q.shape
        cos2d = cos.detach().expand(s, b, 1, dim).reshape(s * b, dim).contiguous()  # [T, d]
        sin2d = sin.detach().expand(s, b, 1, dim).reshape(s * b, dim).contiguous()
        return self.rotate(q, cos2d, sin2d, False), self.rotate(k, cos2d, sin2d, False)


def _registered(name: str) -> OpOverload:
    """The registered op gpt_kernels::<name> (its signature is the launch's: looked up by name)."""
    return getattr(getattr(torch.ops, OP_NAMESPACE), name).default


# ---- fake (meta) implementations: every op returns fresh tensors ------------------------------------------
def _like_first(x: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(x)


def _like_y(grad: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.empty_like(y)


def _swiglu_fake(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y.new_empty(*y.shape[:-1], y.shape[-1] // 2)


def _bias_dropout_add_fake(
    y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    return torch.empty_like(residual)


def _norm_fwd_fake(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, is_rms: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    stats = x2d.new_empty(x2d.shape[0], dtype=torch.float32)
    return torch.empty_like(x2d), stats, torch.empty_like(stats)


def _norm_bwd_fake(
    grad: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    has_bias: bool,
    is_rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_rows, hidden = x2d.shape
    block_rows = ops.rows_per_block(ops.triton_kernels().next_power_of_2(hidden), n_rows, x2d.device)
    programs, _ = ops.backward_programs(n_rows, block_rows, x2d.device)
    dw_part = x2d.new_empty(programs, hidden, dtype=torch.float32)
    return torch.empty_like(x2d), dw_part, dw_part.new_empty(programs if has_bias else 0, hidden)


def _grouped_mm_fake(x: torch.Tensor, weights: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weights.shape[1])


def _grouped_mm_weight_grad_fake(grad: torch.Tensor, x: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    return grad.new_empty(group_ends.shape[0], grad.shape[1], x.shape[1])


# ---- autograd formulas (the backward calls the registered backward ops) ----------------------------------
class _OpContext(Protocol):
    """The context object torch.library hands an op's setup_context and backward."""

    saved_tensors: tuple[Tensor | None, ...]
    needs_input_grad: tuple[bool, ...]

    def save_for_backward(self, *tensors: Tensor | None) -> None: ...


class _NormContext(_OpContext, Protocol):
    has_bias: bool
    is_rms: bool
    weight_dtype: torch.dtype
    bias_dtype: torch.dtype | None


class _RotateContext(_OpContext, Protocol):
    backward: bool


def _save_y_bias(ctx: _OpContext, inputs: tuple[Tensor, Tensor | None], output: object) -> None:
    y, bias = inputs
    ctx.save_for_backward(y.contiguous(), bias)


def _bias_grad(ctx: _OpContext, index: int, grad: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias gradient when autograd asks for it (fp32 sum over tokens, in the bias dtype)."""
    return ops.bias_grad(grad, bias) if ctx.needs_input_grad[index] else None


def _gelu_backward(ctx: _OpContext, grad: Tensor) -> tuple[Tensor, Tensor | None]:
    y, bias = ctx.saved_tensors
    grad_y = _registered("bias_gelu_bwd")(grad, y, bias)
    return grad_y, _bias_grad(ctx, 1, grad_y, bias)


def _swiglu_backward(ctx: _OpContext, grad: Tensor) -> tuple[Tensor, Tensor | None]:
    y, bias = ctx.saved_tensors
    grad_y = _registered("bias_swiglu_bwd")(grad, y, bias)
    return grad_y, _bias_grad(ctx, 1, grad_y, bias)


def _bda_setup(ctx: _OpContext, inputs: tuple[Tensor, Tensor | None, Tensor, Tensor | None], output: object) -> None:
    _, bias, _, scaled_mask = inputs
    ctx.save_for_backward(scaled_mask, bias)


def _bda_backward(ctx: _OpContext, grad: Tensor) -> tuple[Tensor, Tensor | None, Tensor, None]:
    scaled_mask, bias = ctx.saved_tensors
    grad = grad.contiguous()
    grad_y = _registered("mul")(grad, scaled_mask) if scaled_mask is not None else grad
    return grad_y, _bias_grad(ctx, 1, grad_y, bias), grad, None


def _norm_setup(
    ctx: _NormContext,
    inputs: tuple[Tensor, Tensor, Tensor | None, float, bool],
    output: tuple[Tensor, Tensor, Tensor],
) -> None:
    x2d, weight, bias, _, is_rms = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x2d, weight, mean, rstd)
    ctx.has_bias, ctx.is_rms = bias is not None, is_rms
    ctx.weight_dtype, ctx.bias_dtype = weight.dtype, bias.dtype if bias is not None else None


def _norm_backward(
    ctx: _NormContext, grad: Tensor, _grad_mean: Tensor | None, _grad_rstd: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None, None, None]:
    x2d, weight, mean, rstd = ctx.saved_tensors
    grad_x, dw_part, db_part = _registered("norm_bwd")(grad, x2d, weight, mean, rstd, ctx.has_bias, ctx.is_rms)
    grad_bias = db_part.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
    return grad_x, dw_part.sum(0).to(ctx.weight_dtype), grad_bias, None, None


def _rotate_setup(ctx: _RotateContext, inputs: tuple[Tensor, Tensor, Tensor, bool], output: object) -> None:
    _, cos2d, sin2d, backward = inputs
    ctx.save_for_backward(cos2d, sin2d)
    ctx.backward = backward


def _rotate_backward(ctx: _RotateContext, grad: Tensor) -> tuple[Tensor, None, None, None]:
    cos2d, sin2d = ctx.saved_tensors
    return _registered("rotate")(grad, cos2d, sin2d, not ctx.backward), None, None, None


def _grouped_mm_setup(ctx: _OpContext, inputs: tuple[Tensor, Tensor, Tensor], output: object) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx: _OpContext, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    """dX = the same grouped multiply of the output gradient by the weights read transposed (in place);
    dW per expert = its rows' output gradient^T @ its rows' input."""
    x, weights, group_ends = ctx.saved_tensors
    assert x is not None and weights is not None and group_ends is not None  # all three are saved tensors
    grad = grad.contiguous()
    grad_x = _registered("grouped_mm")(grad, weights.transpose(-2, -1), group_ends) if ctx.needs_input_grad[0] else None
    grad_w = _registered("grouped_mm_weight_grad")(grad, x, group_ends) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


# name -> (launch, fake, (backward, setup_context) or None); backward ops first, each forward op's formula
# calls them
Launch = Callable[..., Tensor | tuple[Tensor, ...]]  # a launch of ops.py, or its fake
Formula = tuple[Callable[..., tuple[Tensor | None, ...]], Callable[..., None]]  # (backward, setup_context)
OP_TABLE: dict[str, tuple[Launch, Launch, Formula | None]] = {
    "bias_gelu_bwd": (ops.bias_gelu_bwd, _like_y, None),
    "bias_swiglu_bwd": (ops.bias_swiglu_bwd, _like_y, None),
    "mul": (ops.mul, _like_first, None),
    "norm_bwd": (ops.norm_bwd, _norm_bwd_fake, None),
    "grouped_mm_weight_grad": (ops.grouped_mm_weight_grad, _grouped_mm_weight_grad_fake, None),
    "bias_gelu": (ops.bias_gelu, _like_first, (_gelu_backward, _save_y_bias)),
    "bias_swiglu": (ops.bias_swiglu, _swiglu_fake, (_swiglu_backward, _save_y_bias)),
    "bias_dropout_add": (ops.bias_dropout_add, _bias_dropout_add_fake, (_bda_backward, _bda_setup)),
    "norm_fwd": (ops.norm_fwd, _norm_fwd_fake, (_norm_backward, _norm_setup)),
    "rotate": (ops.rotate, _like_first, (_rotate_backward, _rotate_setup)),
    "grouped_mm": (ops.grouped_mm, _grouped_mm_fake, (_grouped_mm_backward, _grouped_mm_setup)),
}


def _define(name: str, launch: Launch) -> CustomOpDef:
    """Register `launch` as the op gpt_kernels::<name> (no argument is mutated: outputs are fresh)."""
    qualname = f"{OP_NAMESPACE}::{name}"
    if ops.USES_TRITON_OP:
        op = torch.library.triton_op(qualname, launch, mutates_args=())
    else:
        op = torch.library.custom_op(qualname, launch, mutates_args=())
    assert isinstance(op, CustomOpDef), op  # given the function, both return the op (not a decorator)
    return op


def register_kernel_ops() -> KernelOps:
    """Register every op not yet in torch's registry (with its fake and autograd formula); return them all."""
    namespace = getattr(torch.ops, OP_NAMESPACE)
    for name, (launch, fake, autograd) in OP_TABLE.items():
        if hasattr(namespace, name):
            continue  # registered by an earlier call in this process
        op = _define(name, launch)
        op.register_fake(fake)
        if autograd is not None:
            backward, setup_context = autograd
            op.register_autograd(backward, setup_context=setup_context)
    return KernelOps(**{name: _registered(name) for name in OP_TABLE})
