"""Autograd functions around the Triton kernels: bias+GeLU, bias+SwiGLU, bias+dropout+add, LayerNorm, RMSNorm
and rotary embedding. Each computes in fp32 inside the kernel and returns the input's dtype, as the references
in model/kernels/reference.py do. Call them only where `triton_runs(tensor)` says Triton can run."""
from __future__ import annotations

from typing import Optional

import torch

from model.kernels.backend import triton_kernels

_ELEMENTWISE_BLOCK = 1024


def _launch_elementwise(kernel, n_elements: int, *args, **constexprs) -> None:
    tk = triton_kernels()
    kernel[tk.elementwise_grid(n_elements, _ELEMENTWISE_BLOCK)](*args, n_elements, **constexprs,
                                                                 BLOCK=_ELEMENTWISE_BLOCK)


def _bias_grad(grad: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Sum of grad [..., n] over every dim but the last, accumulated in fp32, in the bias dtype."""
    if bias is None or not bias.requires_grad:
        return None
    return grad.reshape(-1, grad.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)


class BiasGeLU(torch.autograd.Function):
    """gelu(y + bias) [..., F]; saves y and bias, recomputes y + bias in backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        y = y.contiguous()
        out = torch.empty_like(y)
        _launch_elementwise(triton_kernels().bias_gelu_fwd, y.numel(), y, bias if bias is not None else y, out,
                            N_COLS=y.shape[-1], HAS_BIAS=bias is not None)
        ctx.save_for_backward(y, bias)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, bias = ctx.saved_tensors
        grad_y = torch.empty_like(y)
        _launch_elementwise(triton_kernels().bias_gelu_bwd, y.numel(), grad.contiguous(), y,
                            bias if bias is not None else y, grad_y, N_COLS=y.shape[-1],
                            HAS_BIAS=bias is not None)
        return grad_y, _bias_grad(grad_y, bias)


class BiasSwiGLU(torch.autograd.Function):
    """silu(gate) * up with [gate, up] = y + bias: y [..., 2F] -> [..., F]."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        y = y.contiguous()
        ffn = y.shape[-1] // 2
        out = y.new_empty(*y.shape[:-1], ffn)
        _launch_elementwise(triton_kernels().bias_swiglu_fwd, out.numel(), y, bias if bias is not None else y,
                            out, F=ffn, HAS_BIAS=bias is not None)
        ctx.save_for_backward(y, bias)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, bias = ctx.saved_tensors
        grad_y = torch.empty_like(y)
        _launch_elementwise(triton_kernels().bias_swiglu_bwd, grad.numel(), grad.contiguous(), y,
                            bias if bias is not None else y, grad_y, F=y.shape[-1] // 2,
                            HAS_BIAS=bias is not None)
        return grad_y, _bias_grad(grad_y, bias)


class BiasDropoutAdd(torch.autograd.Function):
    """residual + scaled_mask * (y + bias), scaled_mask (0 or 1/(1-p), drawn by the caller) or None."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                scaled_mask: Optional[torch.Tensor]) -> torch.Tensor:
        y, residual = y.contiguous(), residual.contiguous()
        out = torch.empty_like(residual)
        _launch_elementwise(triton_kernels().bias_dropout_add_fwd, y.numel(), y,
                            bias if bias is not None else y, scaled_mask if scaled_mask is not None else y,
                            residual, out, N_COLS=y.shape[-1], HAS_BIAS=bias is not None,
                            HAS_MASK=scaled_mask is not None)
        ctx.save_for_backward(scaled_mask, bias)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scaled_mask, bias = ctx.saved_tensors
        grad = grad.contiguous()
        grad_y = grad
        if scaled_mask is not None:
            grad_y = torch.empty_like(grad)
            _launch_elementwise(triton_kernels().mul_fwd, grad.numel(), grad, scaled_mask, grad_y)
        return grad_y, _bias_grad(grad_y, bias), grad, None


def _rows_per_program(n_rows: int, device: torch.device) -> int:
    """Rows each backward program walks: enough programs to fill the device (SMs x 4), few partial dw rows."""
    programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, -(-n_rows // programs))


class Norm(torch.autograd.Function):
    """LayerNorm (with or without bias) or RMSNorm over the last dim, statistics in fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                is_rms: bool) -> torch.Tensor:
        tk = triton_kernels()
        hidden = x.shape[-1]
        x2d = x.reshape(-1, hidden).contiguous()  # [N, h]
        n_rows = x2d.shape[0]
        y = torch.empty_like(x2d)
        mean = torch.empty(n_rows, device=x.device, dtype=torch.float32)
        rstd = torch.empty_like(mean)
        tk.norm_fwd[(n_rows,)](x2d, weight, bias if bias is not None else weight, y, mean, rstd, eps, H=hidden,
                               BLOCK=tk.next_power_of_2(hidden), IS_RMS=is_rms, HAS_BIAS=bias is not None)
        ctx.save_for_backward(x2d, weight, bias, mean, rstd)
        ctx.is_rms = is_rms
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tk = triton_kernels()
        x2d, weight, bias, mean, rstd = ctx.saved_tensors
        n_rows, hidden = x2d.shape
        rows = _rows_per_program(n_rows, x2d.device)
        programs = -(-n_rows // rows)
        grad_x = torch.empty_like(x2d)
        dw_part = torch.empty(programs, hidden, device=x2d.device, dtype=torch.float32)
        db_part = torch.empty_like(dw_part) if bias is not None else dw_part
        tk.norm_bwd[(programs,)](grad.reshape(-1, hidden).contiguous(), x2d, weight, mean, rstd, grad_x, dw_part,
                                 db_part, n_rows, H=hidden, BLOCK=tk.next_power_of_2(hidden),
                                 ROWS_PER_PROGRAM=rows, IS_RMS=ctx.is_rms, HAS_BIAS=bias is not None)
        grad_bias = db_part.sum(0).to(bias.dtype) if bias is not None else None
        return grad_x.view(grad.shape), dw_part.sum(0).to(weight.dtype), grad_bias, None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x [s, b, n, d] rotated by cos/sin [T = s*b, d]."""
    tk = triton_kernels()
    s, b, heads, dim = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    tk.rotary_kernel[(s * b,)](x, cos, sin, out, N_HEADS=heads, D=dim, BLOCK_HEADS=tk.next_power_of_2(heads),
                               BLOCK_HALF=tk.next_power_of_2(dim // 2), BACKWARD=backward)
    return out


class RotaryQK(torch.autograd.Function):
    """q [s, b, nq, d] and k [s, b, nkv, d] rotated by cos, sin [s, b, 1, d] (no gradient to the angles)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        s, b, _, dim = q.shape
        cos2d = cos.expand(s, b, 1, dim).reshape(s * b, dim).contiguous()  # [T, d]
        sin2d = sin.expand(s, b, 1, dim).reshape(s * b, dim).contiguous()
        ctx.save_for_backward(cos2d, sin2d)
        return _rotate(q, cos2d, sin2d, False), _rotate(k, cos2d, sin2d, False)

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor):
        cos2d, sin2d = ctx.saved_tensors
        return _rotate(grad_q, cos2d, sin2d, True), _rotate(grad_k, cos2d, sin2d, True), None, None
