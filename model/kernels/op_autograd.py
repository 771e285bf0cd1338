"""Fake (meta) implementations and autograd formulas of the custom ops in model/kernels/ops.py.

A fake implementation gives an op's output shapes and dtypes without running it: torch.compile traces with
them. Each backward formula calls the ops' own backward kernels (custom ops too), so the backward graph that
AOTAutograd traces holds no graph break either. The formulas are those of the autograd.Functions they replace,
in the same order, so eager numbers are bitwise unchanged."""

from __future__ import annotations

from typing import Any

import torch

from model.kernels import ops


def _register_fakes() -> None:
    """Output shapes only: every op returns fresh tensors."""

    def like_first(x: torch.Tensor, *args: Any) -> torch.Tensor:
        return torch.empty_like(x)

    def like_y(grad: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.empty_like(y)

    def swiglu(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return y.new_empty(*y.shape[:-1], y.shape[-1] // 2)

    def bias_dropout_add(y: torch.Tensor, bias: Any, residual: torch.Tensor, mask: Any) -> torch.Tensor:
        return torch.empty_like(residual)

    def norm_fwd(x2d: torch.Tensor, weight: torch.Tensor, bias: Any, eps: float, is_rms: bool):
        stats = x2d.new_empty(x2d.shape[0], dtype=torch.float32)
        return torch.empty_like(x2d), stats, torch.empty_like(stats)

    def norm_bwd(grad, x2d: torch.Tensor, weight, mean, rstd, has_bias: bool, is_rms: bool):
        n_rows, hidden = x2d.shape
        block_rows = ops.rows_per_block(ops.triton_kernels().next_power_of_2(hidden), n_rows, x2d.device)
        programs, _ = ops._backward_programs(n_rows, block_rows, x2d.device)
        dw_part = x2d.new_empty(programs, hidden, dtype=torch.float32)
        return torch.empty_like(x2d), dw_part, dw_part.new_empty(programs if has_bias else 0, hidden)

    for op, fake in (
        (ops.bias_gelu, like_first),
        (ops.bias_gelu_bwd, like_y),
        (ops.bias_swiglu, swiglu),
        (ops.bias_swiglu_bwd, like_y),
        (ops.bias_dropout_add, bias_dropout_add),
        (ops.mul, like_first),
        (ops.norm_fwd, norm_fwd),
        (ops.norm_bwd, norm_bwd),
        (ops.rotate, like_first),
    ):
        op.register_fake(fake)


def _save_y_bias(ctx: Any, inputs: tuple, output: Any) -> None:
    y, bias = inputs
    ctx.save_for_backward(y.contiguous(), bias)


def _bias_grad(ctx: Any, index: int, grad: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias gradient when autograd asks for it (fp32 sum over tokens, in the bias dtype)."""
    return ops._bias_grad(grad, bias) if ctx.needs_input_grad[index] else None


def _gelu_backward(ctx: Any, grad: torch.Tensor):
    y, bias = ctx.saved_tensors
    grad_y = ops.bias_gelu_bwd(grad, y, bias)
    return grad_y, _bias_grad(ctx, 1, grad_y, bias)


def _swiglu_backward(ctx: Any, grad: torch.Tensor):
    y, bias = ctx.saved_tensors
    grad_y = ops.bias_swiglu_bwd(grad, y, bias)
    return grad_y, _bias_grad(ctx, 1, grad_y, bias)


def _bda_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    _, bias, _, scaled_mask = inputs
    ctx.save_for_backward(scaled_mask, bias)


def _bda_backward(ctx: Any, grad: torch.Tensor):
    scaled_mask, bias = ctx.saved_tensors
    grad = grad.contiguous()
    grad_y = ops.mul(grad, scaled_mask) if scaled_mask is not None else grad
    return grad_y, _bias_grad(ctx, 1, grad_y, bias), grad, None


def _norm_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    x2d, weight, bias, _, is_rms = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x2d, weight, mean, rstd)
    ctx.has_bias, ctx.is_rms = bias is not None, is_rms
    ctx.weight_dtype, ctx.bias_dtype = weight.dtype, bias.dtype if bias is not None else None


def _norm_backward(ctx: Any, grad: torch.Tensor, _grad_mean: Any, _grad_rstd: Any):
    x2d, weight, mean, rstd = ctx.saved_tensors
    grad_x, dw_part, db_part = ops.norm_bwd(grad, x2d, weight, mean, rstd, ctx.has_bias, ctx.is_rms)
    grad_bias = db_part.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
    return grad_x, dw_part.sum(0).to(ctx.weight_dtype), grad_bias, None, None


def _rotate_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    _, cos2d, sin2d, backward = inputs
    ctx.save_for_backward(cos2d, sin2d)
    ctx.backward = backward


def _rotate_backward(ctx: Any, grad: torch.Tensor):
    cos2d, sin2d = ctx.saved_tensors
    return ops.rotate(grad, cos2d, sin2d, not ctx.backward), None, None, None


def _register_autograd() -> None:
    ops.bias_gelu.register_autograd(_gelu_backward, setup_context=_save_y_bias)
    ops.bias_swiglu.register_autograd(_swiglu_backward, setup_context=_save_y_bias)
    ops.bias_dropout_add.register_autograd(_bda_backward, setup_context=_bda_setup)
    ops.norm_fwd.register_autograd(_norm_backward, setup_context=_norm_setup)
    ops.rotate.register_autograd(_rotate_backward, setup_context=_rotate_setup)


_register_fakes()
_register_autograd()
