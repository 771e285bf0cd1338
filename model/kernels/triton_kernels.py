"""The Triton kernels behind model/kernels (imported only when Triton runs: on CUDA, or on CPU tensors under
the interpreter, TRITON_INTERPRET=1, which must be set before this module is imported).

Rules these kernels keep so that they run on Triton 3.6 (the GPU machine) and in the interpreter:
- every loop bound is a `tl.constexpr` (Triton 3.6 with numpy 2.4 breaks loops over runtime bounds in the
  interpreter), so a kernel is specialised per hidden / vocabulary size, which is fixed in a run;
- arithmetic in fp32 after each load (the interpreter's bf16 arithmetic is wrong), stored in the output dtype;
- tensors are contiguous and row-major; the wrappers in model/kernels/ops.py make them so.
"""

from __future__ import annotations

import triton
import triton.language as tl

_SQRT1_2 = tl.constexpr(0.7071067811865476)  # a plain global compiles only in the interpreter
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


# ---- bias + GeLU (exact erf GeLU, as F.gelu) ------------------------------------------------------------
# Twin of bias_gelu_bwd: the same prologue (load x, add the bias), kept inline in each kernel (one fused pass).
@triton.jit
def bias_gelu_fwd(x_ptr, b_ptr, y_ptr, n_elements, N_COLS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(b_ptr + offs % N_COLS, mask=mask, other=0.0).to(tl.float32)
    y = 0.5 * x * (1.0 + tl.math.erf(x * _SQRT1_2))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


# Twin of bias_gelu_fwd: recomputes its prologue (x + bias) instead of saving the sum.
@triton.jit
def bias_gelu_bwd(
    g_ptr, x_ptr, b_ptr, dx_ptr, n_elements, N_COLS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(b_ptr + offs % N_COLS, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    cdf = 0.5 * (1.0 + tl.math.erf(x * _SQRT1_2))
    pdf = tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
    tl.store(dx_ptr + offs, (g * (cdf + x * pdf)).to(dx_ptr.dtype.element_ty), mask=mask)


# ---- bias + SwiGLU: y [N, 2F] = [gate, up] -> silu(gate) * up [N, F] ---------------------------------------
# Twin of bias_swiglu_bwd: the same prologue (load gate and up, add their biases), inline in each kernel.
@triton.jit
def bias_swiglu_fwd(y_ptr, b_ptr, out_ptr, n_elements, F: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    row, col = offs // F, offs % F
    gate = tl.load(y_ptr + row * 2 * F + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(y_ptr + row * 2 * F + F + col, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        gate += tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(b_ptr + F + col, mask=mask, other=0.0).to(tl.float32)
    out = gate * (1.0 / (1.0 + tl.exp(-gate))) * up
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


# Twin of bias_swiglu_fwd: recomputes its prologue (gate, up + biases) instead of saving them.
@triton.jit
def bias_swiglu_bwd(
    g_ptr, y_ptr, b_ptr, dy_ptr, n_elements, F: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    row, col = offs // F, offs % F
    gate = tl.load(y_ptr + row * 2 * F + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(y_ptr + row * 2 * F + F + col, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        gate += tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(b_ptr + F + col, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    d_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = g * gate * sig
    tl.store(dy_ptr + row * 2 * F + col, d_gate.to(dy_ptr.dtype.element_ty), mask=mask)
    tl.store(dy_ptr + row * 2 * F + F + col, d_up.to(dy_ptr.dtype.element_ty), mask=mask)


# ---- bias + dropout + residual add: out = residual + scaled_mask * (y + bias) ------------------------------
@triton.jit
def bias_dropout_add_fwd(
    y_ptr,
    b_ptr,
    mask_ptr,
    res_ptr,
    out_ptr,
    n_elements,
    N_COLS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs % N_COLS, mask=mask, other=0.0).to(tl.float32)
    if HAS_MASK:
        y = y * tl.load(mask_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32) + y
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def mul_fwd(a_ptr, b_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    """out = a * b (the dropout backward: grad * scaled mask)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (a * b).to(out_ptr.dtype.element_ty), mask=mask)


# ---- LayerNorm / RMSNorm over the last dim, BLOCK_ROWS rows per program ------------------------------------
@triton.jit
def norm_fwd(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    n_rows,
    eps,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < H)[None, :]
    offs = rows[:, None] * H + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / H
        xc = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(mean_ptr + rows, mean, mask=row_mask)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / H + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    y = xc * rstd[:, None] * tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def norm_bwd(
    g_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    db_part_ptr,
    n_rows,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ITERS: tl.constexpr,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """dx for ITERS blocks of BLOCK_ROWS rows, and this program's partial sums of dw (and db) [programs, H]."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dw_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for i in range(ITERS):
        rows = (pid.to(tl.int64) * ITERS + i) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows[:, None] * H + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
        if IS_RMS:
            xhat = x * rstd
        else:
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        wg = w * g
        c1 = (tl.sum(xhat * wg, axis=1) / H)[:, None]
        if IS_RMS:
            dx = (wg - xhat * c1) * rstd
        else:
            dx = (wg - (xhat * c1 + (tl.sum(wg, axis=1) / H)[:, None])) * rstd
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(g * xhat, axis=0)
        if HAS_BIAS:
            db_acc += tl.sum(g, axis=0)
    tl.store(dw_part_ptr + pid * H + cols, dw_acc, mask=col_mask)
    if HAS_BIAS:
        tl.store(db_part_ptr + pid * H + cols, db_acc, mask=col_mask)


# ---- rotary embedding (rotate-half layout), all heads of BLOCK_T tokens per program -------------------------
@triton.jit
def rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n_tokens,
    N_HEADS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Forward: out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2 (x [T, heads, D], cos/sin [T, D]).
    Backward (the transposed rotation): dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1."""
    HALF: tl.constexpr = D // 2
    tokens = (tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None, None]
    heads = tl.arange(0, BLOCK_HEADS)[None, :, None]
    j = tl.arange(0, BLOCK_HALF)[None, None, :]
    angle_mask = (tokens < n_tokens) & (j < HALF)
    mask = angle_mask & (heads < N_HEADS)
    base = tokens * N_HEADS * D + heads * D + j
    x1 = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF, mask=mask, other=0.0).to(tl.float32)
    angle = tokens * D + j
    c1 = tl.load(cos_ptr + angle, mask=angle_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + angle + HALF, mask=angle_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + angle, mask=angle_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + angle + HALF, mask=angle_mask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    tl.store(out_ptr + base, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + base + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


# ---- cross entropy over one chunk of fp32 logits [C, V_local], BLOCK_R rows per program ---------------------
@triton.jit
def ce_chunk_stats(
    logits_ptr,
    target_ptr,
    max_ptr,
    sumexp_ptr,
    tlogit_ptr,
    n_rows,
    vocab_start,
    num_valid,
    V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Per row: local max over the valid columns (< num_valid), sum of exp(logit - local max), and the target's
    logit when this shard owns the target (else 0). An online max keeps it to one pass over the row."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    target = (tl.load(target_ptr + rows, mask=row_mask, other=0) - vocab_start)[:, None]
    m = tl.full([BLOCK_R, BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
    t = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = (start + tl.arange(0, BLOCK_V))[None, :]
        valid = (cols < num_valid) & row_mask[:, None]
        x = tl.load(logits_ptr + rows[:, None] * V + cols, mask=valid, other=float("-inf"))
        m_new = tl.maximum(m, x)
        # lanes that saw no valid column yet keep m = -inf: shift by 0 there, so no (-inf) - (-inf)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
        t += tl.where(valid & (cols == target), x, 0.0)  # a target of another shard matches no column
    row_max = tl.max(m, axis=1)
    s = s * tl.exp(m - tl.where(row_max == float("-inf"), 0.0, row_max)[:, None])
    tl.store(max_ptr + rows, row_max, mask=row_mask)
    tl.store(sumexp_ptr + rows, tl.sum(s, axis=1), mask=row_mask)
    tl.store(tlogit_ptr + rows, tl.sum(t, axis=1), mask=row_mask)


@triton.jit
def ce_chunk_grad(
    logits_ptr,
    target_ptr,
    lse_ptr,
    grad_loss_ptr,
    n_rows,
    vocab_start,
    num_valid,
    V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """In place: logits -> grad_loss * (softmax - onehot(target)); padding columns get 0."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    target = (tl.load(target_ptr + rows, mask=row_mask, other=0) - vocab_start)[:, None]
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)[:, None]
    g = tl.load(grad_loss_ptr + rows, mask=row_mask, other=0.0)[:, None]
    for start in range(0, V, BLOCK_V):
        cols = (start + tl.arange(0, BLOCK_V))[None, :]
        in_row = (cols < V) & row_mask[:, None]
        x = tl.load(logits_ptr + rows[:, None] * V + cols, mask=in_row, other=0.0)
        p = tl.where(cols < num_valid, tl.exp(x - lse), 0.0)
        p = p - tl.where(cols == target, 1.0, 0.0)
        tl.store(logits_ptr + rows[:, None] * V + cols, p * g, mask=in_row)


def elementwise_grid(n_elements: int, block: int) -> tuple[int]:
    return (triton.cdiv(n_elements, block),)


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(n)
