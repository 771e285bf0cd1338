"""The Triton launches behind the fused ops: bias+GeLU, bias+SwiGLU, bias+dropout+add, LayerNorm, RMSNorm,
rotary embedding and the experts' grouped matrix multiply, forwards and backwards, as plain functions. model/kernels/registry.py registers each one as
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
from dataclasses import dataclass
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


# ---- grouped matrix multiply over the experts' token groups ----------------------------------------------
@dataclass(frozen=True)
class GroupedMMBlocks:
    """The tile of one grouped_mm program: rows x columns of the output, BLOCK_K of the reduction per trip."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int


def grouped_mm_blocks(element_size: int, device: torch.device) -> GroupedMMBlocks:
    """Compiled: 64 x 64 output tiles, 32 fp32 or 64 16-bit numbers of the reduction per trip (the tiles of
    Triton's matmul tutorial on 4 warps; untimed: no GPU has run them). Interpreter: fewer, larger programs
    (its cost is per program and per trip), tiles still smaller than a test's groups so tiling is exercised."""
    if device.type == "cuda":
        return GroupedMMBlocks(64, 64, 32 if element_size == 4 else 64, 4)
    return GroupedMMBlocks(32, 64, 64, 4)


def grouped_mm_row_trips(n_rows: int, block_k: int) -> int:
    """Trips over one group's rows in the weight gradient: enough for a group of all n_rows rows, n_rows rounded
    up to a power of two so that a varying row count (capacity dropping) compiles a few kernels, not one per
    count (the loop bound is a constexpr: see model/kernels/triton_kernels.py)."""
    return -(-triton_kernels().next_power_of_2(max(n_rows, 1)) // block_k)


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """x [P, K] in E consecutive row groups (group_ends [E] int32: each group's end row, the last = P; empty
    groups allowed), weights [E, N, K] -> [P, N], group e times weights[e]^T. The weights may also be the
    transposed view of [E, K, N] storage (the input gradient passes the forward's weights.transpose(-2, -1)):
    read where they lie, not copied."""
    tk = triton_kernels()
    x = x.contiguous()
    num_experts, n_out, k_in = weights.shape
    b_nk = weights.is_contiguous()
    if not (b_nk or weights.transpose(-2, -1).is_contiguous()):
        weights, b_nk = weights.contiguous(), True
    blocks = grouped_mm_blocks(x.element_size(), x.device)
    out = x.new_empty(x.shape[0], n_out)
    grid = (-(-x.shape[0] // blocks.block_m) + num_experts, -(-n_out // blocks.block_n))
    _launcher(tk.grouped_mm)[grid](
        x,
        weights,
        out,
        group_ends,
        x.shape[0],
        E=num_experts,
        M=0,  # not used: the groups' rows are the M dimension
        N=n_out,
        K=k_in,
        GROUPED_K=False,
        B_NK=b_nk,
        BLOCK_E=tk.next_power_of_2(num_experts),
        BLOCK_M=blocks.block_m,
        BLOCK_N=blocks.block_n,
        BLOCK_K=blocks.block_k,
        K_TRIPS=-(-k_in // blocks.block_k),
        UPCAST=interpreter_on(),
        num_warps=blocks.num_warps,
    )
    return out


def grouped_mm_weight_grad(grad: torch.Tensor, x: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """The weight gradient of grouped_mm: [E, N, K], expert e's = grad[rows of e]^T [N, n_e] @ x[rows of e]
    [n_e, K] (zeros for an empty group), from grad [P, N] and x [P, K], in grad's dtype."""
    tk = triton_kernels()
    grad, x = grad.contiguous(), x.contiguous()
    (n_rows, n_out), k_in, num_experts = grad.shape, x.shape[1], group_ends.shape[0]
    blocks = grouped_mm_blocks(x.element_size(), x.device)
    out = grad.new_empty(num_experts, n_out, k_in)
    grid = (num_experts * -(-n_out // blocks.block_m), -(-k_in // blocks.block_n))
    _launcher(tk.grouped_mm)[grid](
        grad,
        x,
        out,
        group_ends,
        n_rows,
        E=num_experts,
        M=n_out,
        N=k_in,
        K=0,  # not used: each group's rows are its reduction
        GROUPED_K=True,
        B_NK=False,
        BLOCK_E=tk.next_power_of_2(num_experts),
        BLOCK_M=blocks.block_m,
        BLOCK_N=blocks.block_n,
        BLOCK_K=blocks.block_k,
        K_TRIPS=grouped_mm_row_trips(n_rows, blocks.block_k),
        UPCAST=interpreter_on(),
        num_warps=blocks.num_warps,
    )
    return out
