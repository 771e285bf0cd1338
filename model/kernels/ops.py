"""The Triton launches behind the fused ops: bias+GeLU, bias+SwiGLU, bias+dropout+add, LayerNorm, RMSNorm and
rotary embedding, forwards and backwards, as plain functions. model/kernels/registry.py registers each one as
a torch custom operator (with its fake implementation and autograd formula); the model calls the registered
ops, never these functions directly. Each computes in fp32 inside the kernel and returns the input's dtype, as
the references in model/kernels/reference.py do. They run only where `triton_runs(tensor)` says Triton can.

Under torch.compile (train.compile) a compiled layer holds the registered ops without a graph break:
- with compiled Triton (CUDA, interpreter off) they are `torch.library.triton_op`s whose launches go through
  `wrap_triton`, so inductor sees the kernels themselves;
- under Triton's interpreter (CPU tests, TRITON_INTERPRET=1), or on a torch without triton_op, they are
  `torch.library.custom_op`s: opaque calls inside the graph (wrap_triton accepts only compiled `@triton.jit`
  kernels, and the interpreter's are not).
Either way eager calls run the same launches, so the numbers do not depend on the kind of op."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from model.kernels.backend import interpreter_on, triton_kernels

ELEMENTWISE_BLOCK = 1024  # elements per program of the elementwise kernels (model/kernels/aot.py compiles it)
# triton_op where the kernels are compiled and torch has it (2.6+; the GPU machine's 2.11 has it), else custom_op
USES_TRITON_OP = hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton") and not interpreter_on()


class TritonKernel(Protocol):
    """A `@triton.jit` kernel (or torch's wrap_triton of one): indexed by its launch grid, then called with the
    kernel's arguments."""

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., object]: ...
    def __call__(self, *args: object, **kwargs: object) -> object: ...  # (called only inside another kernel)


def _launcher(kernel: TritonKernel) -> TritonKernel:
    """The kernel, wrapped so that torch.compile can trace its launch when the ops are triton_ops."""
    return torch.library.wrap_triton(kernel) if USES_TRITON_OP else kernel


def _launch_elementwise(kernel: TritonKernel, n_elements: int, *args: torch.Tensor, **constexprs: int) -> None:
    tk = triton_kernels()
    grid = tk.elementwise_grid(n_elements, ELEMENTWISE_BLOCK)
    _launcher(kernel)[grid](*args, n_elements, **constexprs, BLOCK=ELEMENTWISE_BLOCK)


def bias_grad(grad: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """Sum of grad [..., n] over every dim but the last, accumulated in fp32, in the bias dtype."""
    if bias is None:
        return None
    return grad.reshape(-1, grad.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)


def _bias_activation_bwd(
    kernel_name: str, n_elements: int, grad: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, **sizes: int
) -> torch.Tensor:
    """grad_y [like y] of act(y + bias) from the backward kernel `kernel_name` over `n_elements` outputs; without
    a bias the kernel is handed y in its place (HAS_BIAS=False: never read)."""
    grad_y = torch.empty_like(y)
    b = bias if bias is not None else y
    kernel = getattr(triton_kernels(), kernel_name)
    _launch_elementwise(kernel, n_elements, grad.contiguous(), y, b, grad_y, **sizes, HAS_BIAS=bias is not None)
    return grad_y


# ---- bias + GeLU: gelu(y + bias) [..., F] ----------------------------------------------------------------
def bias_gelu(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu(y + bias), y [..., F], bias [F] or None."""
    y = y.contiguous()
    out = torch.empty_like(y)
    has_bias = bias is not None
    b = bias if bias is not None else y
    _launch_elementwise(triton_kernels().bias_gelu_fwd, y.numel(), y, b, out, N_COLS=y.shape[-1], HAS_BIAS=has_bias)
    return out


def bias_gelu_bwd(grad: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """d gelu(y + bias) / dy * grad."""
    return _bias_activation_bwd("bias_gelu_bwd", y.numel(), grad, y, bias, N_COLS=y.shape[-1])


# ---- bias + SwiGLU: silu(gate) * up with [gate, up] = y + bias, y [..., 2F] -> [..., F] --------------------
def bias_swiglu(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up of [gate, up] = y + bias, y [..., 2F] -> [..., F]."""
    y = y.contiguous()
    ffn = y.shape[-1] // 2
    out = y.new_empty(*y.shape[:-1], ffn)
    b = bias if bias is not None else y
    _launch_elementwise(triton_kernels().bias_swiglu_fwd, out.numel(), y, b, out, F=ffn, HAS_BIAS=bias is not None)
    return out


def bias_swiglu_bwd(grad: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The gradient of bias_swiglu with respect to y [..., 2F], from grad [..., F]."""
    return _bias_activation_bwd("bias_swiglu_bwd", grad.numel(), grad, y, bias, F=y.shape[-1] // 2)


# ---- bias + dropout + residual add: residual + scaled_mask * (y + bias) ------------------------------------
def bias_dropout_add(
    y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, scaled_mask: torch.Tensor | None
) -> torch.Tensor:
    """residual + scaled_mask * (y + bias); scaled_mask (0 or 1/(1-p), drawn by the caller) or None."""
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
    return out


def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a * b elementwise (the dropout backward: grad * scaled mask)."""
    a = a.contiguous()
    out = torch.empty_like(a)
    _launch_elementwise(triton_kernels().mul_fwd, a.numel(), a, b, out)
    return out


# ---- LayerNorm / RMSNorm over the last dim ---------------------------------------------------------------
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


def backward_programs(n_rows: int, block_rows: int, device: torch.device) -> tuple[int, int]:
    """(programs, row blocks per program) of the norm backward: enough programs to fill the device (SMs x 4)
    and few partial dw rows to sum."""
    blocks = -(-n_rows // block_rows)
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    iters = -(-blocks // min(blocks, target))
    return -(-blocks // iters), iters


def norm_fwd(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, is_rms: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [N, h], mean [N], rstd [N]) of x2d [N, h] (contiguous); statistics in fp32."""
    tk = triton_kernels()
    n_rows, hidden = x2d.shape
    y = torch.empty_like(x2d)
    mean = torch.empty(n_rows, device=x2d.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    block_h = tk.next_power_of_2(hidden)
    block_rows = rows_per_block(block_h, n_rows, x2d.device)
    _launcher(tk.norm_fwd)[(-(-n_rows // block_rows),)](
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
    return y, mean, rstd


def norm_bwd(
    grad: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    has_bias: bool,
    is_rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x [N, h], per-program partial sums dw [P, h] and db [P, h] in fp32; db [0, h] without a bias)."""
    tk = triton_kernels()
    n_rows, hidden = x2d.shape
    block_h = tk.next_power_of_2(hidden)
    block_rows = rows_per_block(block_h, n_rows, x2d.device)
    programs, iters = backward_programs(n_rows, block_rows, x2d.device)
    grad_x = torch.empty_like(x2d)
    dw_part = torch.empty(programs, hidden, device=x2d.device, dtype=torch.float32)
    # without a bias the kernel writes no db: hand it dw's buffer and return an empty db (outputs may not alias)
    db_part = torch.empty_like(dw_part) if has_bias else dw_part.new_empty(0, hidden)
    _launcher(tk.norm_bwd)[(programs,)](
        grad.contiguous(),
        x2d,
        weight,
        mean,
        rstd,
        grad_x,
        dw_part,
        db_part if has_bias else dw_part,
        n_rows,
        H=hidden,
        BLOCK_H=block_h,
        BLOCK_ROWS=block_rows,
        ITERS=iters,
        IS_RMS=is_rms,
        HAS_BIAS=has_bias,
        num_warps=warps_for(block_h * block_rows),
    )
    return grad_x, dw_part, db_part


# ---- rotary embedding ------------------------------------------------------------------------------------
def rotate(x: torch.Tensor, cos2d: torch.Tensor, sin2d: torch.Tensor, backward: bool) -> torch.Tensor:
    """x [s, b, n, d] rotated by cos/sin [T = s*b, d] (by the inverse rotation when `backward`)."""
    tk = triton_kernels()
    s, b, heads, dim = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    block_heads, block_half = tk.next_power_of_2(heads), tk.next_power_of_2(dim // 2)
    n_tokens = s * b
    block_t = rows_per_block(block_heads * block_half, n_tokens, x.device)
    _launcher(tk.rotary_kernel)[(-(-n_tokens // block_t),)](
        x,
        cos2d,
        sin2d,
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
