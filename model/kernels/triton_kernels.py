"""The Triton kernels behind model/kernels (imported only when Triton runs: on CUDA, or on CPU tensors under
the interpreter, TRITON_INTERPRET=1, which must be set before this module is imported).

Rules these kernels keep so that they run on Triton 3.6 (the GPU machine) and in the interpreter:
- every loop bound is a `tl.constexpr` (Triton 3.6 with numpy 2.4 breaks loops over runtime bounds in the
  interpreter), so a kernel is specialised per hidden / vocabulary size, which is fixed in a run; the one
  loop over a runtime length, the grouped multiply's weight gradient over a group's rows, is bounded by the
  total row count rounded up to a power of two (ops.grouped_mm_row_trips) and skips the trips past the group;
- arithmetic in fp32 after each load (the interpreter's bf16 arithmetic is wrong), stored in the output dtype;
  the grouped multiply's compiled tl.dot takes 16-bit operands as they are (tensor cores: exact products,
  fp32 accumulation) and upcasts only under the interpreter;
- tensors are contiguous and row-major; the wrappers in model/kernels/ops.py make them so (the grouped
  multiply also reads its weights transposed in place, a layout it is told as a constexpr).
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


# ---- grouped matrix multiply over the experts' token groups (MoE experts) ----------------------------------
# Groups are consecutive rows given by their cumulative ends (int32 [E], the last = n_rows; empty groups
# allowed). One kernel does the three products of a grouped linear layer:
# - GROUPED_K False, the forward and the input gradient: C [n_rows, N] = A [n_rows, K] @ B_e for each group e
#   of rows; B is [E, N, K] (B_NK: nn.Linear's layout, the forward) or [E, K, N] (the input gradient reads the
#   forward's weights as they lie). Axis 0 walks the groups' row tiles: at most cdiv(n_rows, BLOCK_M) + E
#   tiles, found from the group ends on the device (no host sync); programs past the last tile return.
# - GROUPED_K True, the weight gradient: C [E, M, N], C_e = A_e^T @ B_e, the reduction over group e's rows;
#   A is [n_rows, M] (the output gradient), B [n_rows, N] (the input). Axis 0 = expert x row tile of C_e;
#   K_TRIPS bounds the trips over a group's rows (a constexpr from n_rows: see the module docstring), the
#   trips past the group's end do nothing, and an empty group writes zeros.
# M is used only when GROUPED_K and K only when not (the grouped dimension is the runtime one).
# UPCAST (the interpreter, whose 16-bit tl.dot is wrong) multiplies in fp32; compiled, 16-bit operands go to
# the tensor cores as they are (exact products, fp32 accumulation), fp32 operands multiply in IEEE fp32.
@triton.jit
def _dot_trip(
    acc,
    a_ptr,
    b_ptr,
    rows,
    m_lo,
    m_hi,
    cols,
    k0,
    k_hi,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """acc + A[rows, k0:k0+BLOCK_K] @ B[k0:k0+BLOCK_K, cols], rows masked to [m_lo, m_hi), k to < k_hi."""
    ks = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
    k_mask = ks < k_hi
    a_mask = ((rows >= m_lo) & (rows < m_hi))[:, None] & k_mask[None, :]
    a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak, mask=a_mask, other=0.0)
    b_mask = k_mask[:, None] & (cols < N)[None, :]
    b = tl.load(b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn, mask=b_mask, other=0.0)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")  # torch's fp32 matmul: no tf32 rounding
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def grouped_mm(
    a_ptr,
    b_ptr,
    c_ptr,
    ends_ptr,
    n_rows,
    E: tl.constexpr,
    M: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    GROUPED_K: tl.constexpr,
    B_NK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TRIPS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    experts = tl.arange(0, BLOCK_E)
    in_range = experts < E
    ends = tl.load(ends_ptr + experts, mask=in_range, other=0).to(tl.int64)
    starts = tl.load(ends_ptr + experts - 1, mask=in_range & (experts > 0), other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GROUPED_K:
        M_TILES: tl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
        expert = pid_m // M_TILES
        rows = (pid_m % M_TILES) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        k_lo = tl.sum(tl.where(experts == expert, starts, 0), axis=0)
        k_hi = tl.sum(tl.where(experts == expert, ends, 0), axis=0)
        for trip in range(K_TRIPS):
            k0 = k_lo + trip * BLOCK_K
            if k0 < k_hi:
                # A_e^T [M, rows of e]: element (m, k) is the output gradient's [k, m]
                acc = _dot_trip(acc, a_ptr, b_ptr, rows, 0, M, cols, k0, k_hi, 1, M, N, 1, N, BLOCK_K, UPCAST)
        out_offs = expert.to(tl.int64) * M * N + rows[:, None] * N + cols[None, :]
        tl.store(c_ptr + out_offs, acc.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])
    else:
        tiles = tl.where(in_range, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        tile_ends = tl.cumsum(tiles, axis=0)
        expert = tl.sum((tile_ends <= pid_m).to(tl.int32), axis=0)  # the group whose tiles hold pid_m
        if expert >= E:
            return  # past the last group's last tile
        this = experts == expert
        m_lo = tl.sum(tl.where(this, starts, 0), axis=0)
        m_hi = tl.sum(tl.where(this, ends, 0), axis=0)
        first_tile = tl.sum(tl.where(this, tile_ends - tiles, 0), axis=0)
        rows = m_lo + (pid_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        b_expert = b_ptr + expert.to(tl.int64) * N * K
        # B_e [K, N] read from [N, K] storage (B_NK) or from [K, N] storage
        stride_bk: tl.constexpr = 1 if B_NK else N
        stride_bn: tl.constexpr = K if B_NK else 1
        for trip in range(K_TRIPS):
            k0 = trip * BLOCK_K
            acc = _dot_trip(
                acc, a_ptr, b_expert, rows, m_lo, m_hi, cols, k0, K, K, 1, stride_bk, stride_bn, N, BLOCK_K, UPCAST
            )
        out_mask = ((rows >= m_lo) & (rows < m_hi))[:, None] & (cols < N)[None, :]
        tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty), mask=out_mask)


def elementwise_grid(n_elements: int, block: int) -> tuple[int]:
    return (triton.cdiv(n_elements, block),)


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(n)
