"""Autograd functions around the Triton kernels: bias+GeLU, bias+SwiGLU, bias+dropout+add, LayerNorm, RMSNorm
and rotary embedding. Each computes in fp32 inside the kernel and returns the input's dtype, as the references
in model/kernels/reference.py do. Call them only where `triton_runs(tensor)` says Triton can run.

Under torch.compile (train.compile) each fused op is an opaque call (`torch.compiler.disable`): dynamo must not
trace into Triton's interpreter, and an opaque launch is what is known to work on every Triton version; the
price is a graph break around each fused op inside a compiled layer."""

from __future__ import annotations

import torch

from model.kernels.backend import triton_kernels

ELEMENTWISE_BLOCK = 1024  # elements per program of the elementwise kernels (model/kernels/aot.py compiles it)


def _launch_elementwise(kernel, n_elements: int, *args, **constexprs) -> None:
    tk = triton_kernels()
    kernel[tk.elementwise_grid(n_elements, ELEMENTWISE_BLOCK)](*args, n_elements, **constexprs, BLOCK=ELEMENTWISE_BLOCK)


def _bias_grad(grad: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """Sum of grad [..., n] over every dim but the last, accumulated in fp32, in the bias dtype."""
    if bias is None or not bias.requires_grad:
        return None
    return grad.reshape(-1, grad.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)


class BiasGeLU(torch.autograd.Function):
    """gelu(y + bias) [..., F]; saves y and bias, recomputes y + bias in backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = y.contiguous()
        out = torch.empty_like(y)
        _launch_elementwise(
            triton_kernels().bias_gelu_fwd,
            y.numel(),
            y,
            bias if bias is not None else y,
            out,
            N_COLS=y.shape[-1],
            HAS_BIAS=bias is not None,
        )
        ctx.save_for_backward(y, bias)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, bias = ctx.saved_tensors
        grad_y = torch.empty_like(y)
        _launch_elementwise(
            triton_kernels().bias_gelu_bwd,
            y.numel(),
            grad.contiguous(),
            y,
            bias if bias is not None else y,
            grad_y,
            N_COLS=y.shape[-1],
            HAS_BIAS=bias is not None,
        )
        return grad_y, _bias_grad(grad_y, bias)


class BiasSwiGLU(torch.autograd.Function):
    """silu(gate) * up with [gate, up] = y + bias: y [..., 2F] -> [..., F]."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = y.contiguous()
        ffn = y.shape[-1] // 2
        out = y.new_empty(*y.shape[:-1], ffn)
        _launch_elementwise(
            triton_kernels().bias_swiglu_fwd,
            out.numel(),
            y,
            bias if bias is not None else y,
            out,
            F=ffn,
            HAS_BIAS=bias is not None,
        )
        ctx.save_for_backward(y, bias)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, bias = ctx.saved_tensors
        grad_y = torch.empty_like(y)
        _launch_elementwise(
            triton_kernels().bias_swiglu_bwd,
            grad.numel(),
            grad.contiguous(),
            y,
            bias if bias is not None else y,
            grad_y,
            F=y.shape[-1] // 2,
            HAS_BIAS=bias is not None,
        )
        return grad_y, _bias_grad(grad_y, bias)


class BiasDropoutAdd(torch.autograd.Function):
    """residual + scaled_mask * (y + bias), scaled_mask (0 or 1/(1-p), drawn by the caller) or None."""

    @staticmethod
    def forward(
        ctx, y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, scaled_mask: torch.Tensor | None
    ) -> torch.Tensor:
        y, residual = y.contiguous(), residual.contiguous()
        out = torch.empty_like(residual)
        _launch_elementwise(
            triton_kernels().bias_dropout_add_fwd,
            y.numel(),
            y,
            bias if bias is not None else y,
            scaled_mask if scaled_mask is not None else y,
            residual,
            out,
            N_COLS=y.shape[-1],
            HAS_BIAS=bias is not None,
            HAS_MASK=scaled_mask is not None,
        )
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


def rows_per_block(block_cols: int, n_rows: int, device: torch.device) -> int:
    """Rows one program takes at once (a power of two): a few on a GPU (registers), as many as fit 64k numbers
    in the interpreter (its cost is per program)."""
    tk = triton_kernels()
    budget = 4096 if device.type == "cuda" else 65536
    return tk.next_power_of_2(max(1, min(n_rows, budget // block_cols)))


def warps_for(elements: int) -> int:
    """Warps of a program that holds `elements` numbers per live tensor: about 16 per thread (norm_bwd keeps
    five such tensors in registers; model/kernels/aot.py checks for spills), between 4 and 16 warps."""
    return min(16, max(4, elements // 512))


def _backward_programs(n_rows: int, block_rows: int, device: torch.device) -> tuple[int, int]:
    """(programs, row blocks per program) of the norm backward: enough programs to fill the device (SMs x 4)
    and few partial dw rows to sum."""
    blocks = -(-n_rows // block_rows)
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    iters = -(-blocks // min(blocks, target))
    return -(-blocks // iters), iters


class Norm(torch.autograd.Function):
    """LayerNorm (with or without bias) or RMSNorm over the last dim, statistics in fp32."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, is_rms: bool
    ) -> torch.Tensor:
        tk = triton_kernels()
        hidden = x.shape[-1]
        x2d = x.reshape(-1, hidden).contiguous()  # [N, h]
        n_rows = x2d.shape[0]
        y = torch.empty_like(x2d)
        mean = torch.empty(n_rows, device=x.device, dtype=torch.float32)
        rstd = torch.empty_like(mean)
        block_h = tk.next_power_of_2(hidden)
        block_rows = rows_per_block(block_h, n_rows, x.device)
        tk.norm_fwd[(-(-n_rows // block_rows),)](
            x2d,
            weight,
            bias if bias is not None else weight,
            y,
            mean,
            rstd,
            n_rows,
            eps,
            H=hidden,
            BLOCK_H=block_h,
            BLOCK_ROWS=block_rows,
            IS_RMS=is_rms,
            HAS_BIAS=bias is not None,
            num_warps=warps_for(block_h * block_rows),
        )
        ctx.save_for_backward(x2d, weight, bias, mean, rstd)
        ctx.is_rms = is_rms
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tk = triton_kernels()
        x2d, weight, bias, mean, rstd = ctx.saved_tensors
        n_rows, hidden = x2d.shape
        block_h = tk.next_power_of_2(hidden)
        block_rows = rows_per_block(block_h, n_rows, x2d.device)
        programs, iters = _backward_programs(n_rows, block_rows, x2d.device)
        grad_x = torch.empty_like(x2d)
        dw_part = torch.empty(programs, hidden, device=x2d.device, dtype=torch.float32)
        db_part = torch.empty_like(dw_part) if bias is not None else dw_part
        tk.norm_bwd[(programs,)](
            grad.reshape(-1, hidden).contiguous(),
            x2d,
            weight,
            mean,
            rstd,
            grad_x,
            dw_part,
            db_part,
            n_rows,
            H=hidden,
            BLOCK_H=block_h,
            BLOCK_ROWS=block_rows,
            ITERS=iters,
            IS_RMS=ctx.is_rms,
            HAS_BIAS=bias is not None,
            num_warps=warps_for(block_h * block_rows),
        )
        grad_bias = db_part.sum(0).to(bias.dtype) if bias is not None else None
        return grad_x.view(grad.shape), dw_part.sum(0).to(weight.dtype), grad_bias, None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x [s, b, n, d] rotated by cos/sin [T = s*b, d]."""
    tk = triton_kernels()
    s, b, heads, dim = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    block_heads, block_half = tk.next_power_of_2(heads), tk.next_power_of_2(dim // 2)
    n_tokens = s * b
    block_t = rows_per_block(block_heads * block_half, n_tokens, x.device)
    tk.rotary_kernel[(-(-n_tokens // block_t),)](
        x,
        cos,
        sin,
        out,
        n_tokens,
        N_HEADS=heads,
        D=dim,
        BLOCK_T=block_t,
        BLOCK_HEADS=block_heads,
        BLOCK_HALF=block_half,
        BACKWARD=backward,
        num_warps=warps_for(block_t * block_heads * block_half),
    )
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


# The entry points the dispatch functions call: opaque to torch.compile (see the module docstring).
bias_gelu = torch.compiler.disable(BiasGeLU.apply)
bias_swiglu = torch.compiler.disable(BiasSwiGLU.apply)
bias_dropout_add = torch.compiler.disable(BiasDropoutAdd.apply)
norm = torch.compiler.disable(Norm.apply)
rotary_qk = torch.compiler.disable(RotaryQK.apply)
