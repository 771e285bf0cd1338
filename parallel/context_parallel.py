"""Context parallelism: each micro-batch's sequence split over the cp group, attention as a ring.

Cutting (Megatron's load balancing for causal attention): the sequence of length s is cut into 2 * cp chunks of
c = s / (2 cp) tokens and cp rank i holds chunks i and 2cp-1-i, so every rank has the same share of the causal
triangle. `cut_microbatch` does this to a micro-batch on the CPU (tokens, labels, loss mask and position ids
keep each token's true position; a per-document attention mask keeps this rank's query rows and all key
columns, reordered by the rank that holds them) and records the whole micro-batch's loss-token count, the
denominator of the loss on every cp rank.

Ring attention (`RingAttention`): the key/value block of each rank travels around the cp group; at every step a
rank posts the asynchronous send of the block it holds and the receive of the next one, then attends to the
held block while the transfer runs, and merges the block's output into its running output by log-sum-exp
(online softmax). With the chunk assignment above, the block of rank j seen by rank i is
    j == i: causal over both local chunks;  j < i: all queries, first key chunk only;
    j > i: second query chunk only, all keys
so the blocks above the causal diagonal are never computed. The backward pass is a ring too: key/value blocks
travel again with the gradient of each block, which comes home after a full turn. The block attention is plain
torch (matmul + logsumexp) on every device: the flash kernels that return the log-sum-exp are private torch
names (torch._scaled_dot_product_flash_attention), so CUDA runs the same path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch.distributed import ProcessGroup

from data.microbatch import Microbatch
from model.tp_hooks import ContextParallelHooks
from parallel.comm import P2P, Collectives, RecordedWork

if TYPE_CHECKING:
    from parallel.state import ParallelState

Selection = tuple[slice, slice, bool]  # query rows, key columns (of the two local chunks), causal


def chunk_indices(seq_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token indices held by `cp_rank`: chunks cp_rank and 2cp-1-cp_rank, [2 * s / (2 cp)]."""
    chunk = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat((first, second))


def cut_microbatch(mb: Microbatch, cp_rank: int, cp_size: int) -> Microbatch:
    """This cp rank's part of a micro-batch (tensors [b, s] -> [b, s / cp]); its `loss_tokens` stays the whole
    micro-batch's loss-mask sum. An attention mask [b, 1, s, s] becomes [b, 1, s / cp, s]: this rank's query
    rows, key columns in rank order (rank j's keys at columns [j s/cp, (j+1) s/cp))."""
    seq_length = mb.tokens.shape[1]
    rank_order = None
    if mb.attention_mask is not None:
        rank_order = torch.cat([chunk_indices(seq_length, cp_size, r) for r in range(cp_size)])
    return mb.cut_sequence(chunk_indices(seq_length, cp_size, cp_rank), rank_order)


def block_selection(step: int, cp_rank: int, cp_size: int, local: int) -> Selection:
    """Which part of the block held at ring step `step` this rank attends to (module docstring)."""
    source = (cp_rank - step) % cp_size
    half = local // 2
    if source == cp_rank:
        return slice(None), slice(None), True
    if source < cp_rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float) -> torch.Tensor:
    """Masked scores [b, g, h, sq, sk] of q [b, g, h, sq, d] against k [b, g, 1, sk, d]; mask [b, 1, sq, sk]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    return scores


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax attention of one block and its log-sum-exp: (out [b, g, h, sq, d], lse [b, g, h, sq]).
    A row that may attend to nothing in this block gets out 0 and lse -inf (it weighs nothing in the merge)."""
    scores = _scores(q, k, mask, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - finite[..., None])
    return torch.matmul(probs, v), lse


def merge_block(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: two partial attentions over disjoint keys -> attention over their union. `lse` is
    finite (the first block a row sees is its own diagonal)."""
    merged = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - merged)[..., None] + block_out * torch.exp(block_lse - merged)[..., None]
    return out, merged


def block_grads(
    saved: tuple[torch.Tensor, ...],
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash-attention backward of one block from the final output's statistics: (dq, dk, dv).
    saved = (q, dout, lse, delta) of the selected rows, delta = rowsum(dout * out)."""
    q, dout, lse, delta = saved
    probs = torch.exp(_scores(q, k, mask, causal, scale) - lse[..., None])  # [b, g, h, sq, sk]
    dv = torch.matmul(probs.transpose(-1, -2), dout).sum(dim=2, keepdim=True)
    dscores = probs * (torch.matmul(dout, v.transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(dscores, k) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), q).sum(dim=2, keepdim=True) * scale
    return dq, dk, dv


class _Ring:
    """The cp group seen by one rank: its neighbours and asynchronous exchanges with them."""

    def __init__(self, comm: Collectives, group: ProcessGroup | None, ranks: list[int], cp_rank: int):
        self.comm, self.group, self.cp_size, self.cp_rank = comm, group, len(ranks), cp_rank
        self.next_rank = ranks[(cp_rank + 1) % self.cp_size]
        self.prev_rank = ranks[(cp_rank - 1) % self.cp_size]

    def pass_on(self, send: torch.Tensor) -> tuple[torch.Tensor, list[RecordedWork]]:
        """Post: send `send` to the next rank, receive the previous rank's into a new buffer; wait later."""
        received = torch.empty_like(send)
        ops = [P2P("send", send, self.next_rank, self.group), P2P("recv", received, self.prev_rank, self.group)]
        return received, self.comm.batch_isend_irecv(ops)


def _wait(works: list[RecordedWork]) -> None:
    for work in works:
        work.wait()


def _mask_block(mask: torch.Tensor | None, rows: slice, cols: slice, source: int, local: int) -> torch.Tensor | None:
    """This block's part of the cut attention mask [b, 1, s/cp, s] (source rank's keys, selected rows/cols)."""
    if mask is None:
        return None
    columns = mask[..., source * local : (source + 1) * local]
    return columns[:, :, rows, cols]


def ring_forward(
    ring: _Ring, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, g, h, s, d], lse [b, g, h, s]) of q against every rank's kv [2, b, g, 1, s, d]."""
    local = q.shape[-2]
    out = lse = torch.empty(0)
    for step in range(ring.cp_size):
        pending: list[RecordedWork] = []
        if step + 1 < ring.cp_size:  # the next block travels while this one is attended to
            next_kv, pending = ring.pass_on(kv)
        rows, cols, causal = block_selection(step, ring.cp_rank, ring.cp_size, local)
        source = (ring.cp_rank - step) % ring.cp_size
        block_mask = _mask_block(mask, rows, cols, source, local)
        block_out, block_lse = block_attention(
            q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], block_mask, causal, scale
        )
        if step == 0:  # the diagonal block covers every row
            out, lse = block_out, block_lse
        else:
            out_rows, lse_rows = merge_block(out[..., rows, :], lse[..., rows], block_out, block_lse)
            out[..., rows, :], lse[..., rows] = out_rows, lse_rows  # autograd is off in Function.forward
        _wait(pending)
        if pending:
            kv = next_kv
    return out, lse


def ring_backward(
    ring: _Ring, saved: tuple[torch.Tensor, ...], kv: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq [b, g, h, s, d], dkv [2, b, g, 1, s, d]): kv travels the ring again; the gradient of each kv block
    travels one step behind it, collecting every rank's part, and arrives home after a full turn."""
    q, dout, lse, delta = saved
    local = q.shape[-2]
    dq = torch.zeros_like(q)
    dkv_works: list[RecordedWork] = []
    dkv_in = torch.empty(0)
    for step in range(ring.cp_size):
        kv_works: list[RecordedWork] = []
        if step + 1 < ring.cp_size:
            next_kv, kv_works = ring.pass_on(kv)
        rows, cols, causal = block_selection(step, ring.cp_rank, ring.cp_size, local)
        source = (ring.cp_rank - step) % ring.cp_size
        rows_saved = (q[..., rows, :], dout[..., rows, :], lse[..., rows], delta[..., rows])
        block_mask = _mask_block(mask, rows, cols, source, local)
        dq_rows, dk, dv = block_grads(rows_saved, kv[0][..., cols, :], kv[1][..., cols, :], block_mask, causal, scale)
        dq[..., rows, :] += dq_rows
        dkv = torch.zeros_like(kv)
        dkv[0][..., cols, :] += dk
        dkv[1][..., cols, :] += dv
        if step > 0:  # the gradient of this block from the ranks that held it before
            _wait(dkv_works)
            dkv += dkv_in
        dkv_in, dkv_works = ring.pass_on(dkv)
        _wait(kv_works)
        if kv_works:
            kv = next_kv
    _wait(dkv_works)
    return dq, dkv_in


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[s, b, n, d] with n heads in `groups` kv groups -> [b, g, n / g, s, d] (a view)."""
    s, b, _, d = t.shape
    return t.reshape(s, b, groups, -1, d).permute(1, 2, 3, 0, 4)


def _kv_block(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [s, b, g, d] -> the block that travels the ring, [2, b, g, 1, s, d] (contiguous: a send buffer)."""
    return torch.stack((k, v)).permute(0, 2, 3, 1, 4).unsqueeze(3).contiguous()


class _RingContext(Protocol):
    """What RingAttention keeps on autograd's context object between forward and backward."""

    ring: _Ring
    scale: float
    saved_tensors: tuple[torch.Tensor, ...]

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None: ...


class RingAttention(torch.autograd.Function):
    """Causal attention over the whole sequence of the cp group; q [s/cp, b, nq, d], k/v [s/cp, b, nkv, d]
    (query heads grouped per kv head, as SelfAttention lays them out) -> context [s/cp, b, nq * d].

    Kept for backward: q, k, v as given (views of the QKV projection's output, as SDPA keeps them), the
    returned context (which the output projection keeps anyway) and the fp32 log-sum-exp per query row;
    the [b, g, h, s, d] layouts and the key/value block are rebuilt in backward."""

    @staticmethod
    def forward(
        ctx: _RingContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, ring: _Ring
    ) -> torch.Tensor:
        s, b, nq, d = q.shape
        groups = k.shape[2]
        scale = 1.0 / d**0.5
        out, lse = ring_forward(ring, _grouped(q, groups), _kv_block(k, v), mask, scale)  # [b, g, h, s, d]
        context = out.permute(3, 0, 1, 2, 4).reshape(s, b, nq * d)
        ctx.save_for_backward(q, k, v, context, lse, mask)
        ctx.ring, ctx.scale = ring, scale
        return context

    @staticmethod
    def backward(ctx: _RingContext, grad_context: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, context, lse, mask = ctx.saved_tensors
        s, b, nq, d = q.shape
        groups = k.shape[2]
        out = _grouped(context.view(s, b, nq, d), groups)
        dout = _grouped(grad_context.reshape(s, b, nq, d), groups)  # [b, g, h, s, d]
        delta = (dout * out).sum(dim=-1)
        q5 = _grouped(q, groups)
        dq5, dkv = ring_backward(ctx.ring, (q5, dout, lse, delta), _kv_block(k, v), mask, ctx.scale)
        dq = dq5.permute(3, 0, 1, 2, 4).reshape(s, b, nq, d)
        dk, dv = (t.squeeze(2).permute(2, 0, 1, 3) for t in dkv)  # [s, b, g, d]
        return dq, dk, dv, None, None


def context_parallel_hooks(state: ParallelState) -> ContextParallelHooks:
    """The model's cp seam for this rank: ring attention over its cp group (one process: the defaults)."""
    if state.cp_size == 1:
        return ContextParallelHooks()
    ring = _Ring(state.comm, state.cp_group, state.cp_ranks, state.cp_rank)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return RingAttention.apply(q, k, v, mask, ring)

    return ContextParallelHooks(attention=attention)
