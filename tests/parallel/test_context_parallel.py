"""Context parallelism: the sequence cut, the block attention with its log-sum-exp, and ring attention (forward
and backward, causal and per-document masks, GQA) against one process's scaled_dot_product_attention."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from data.loader import get_batch_masks
from data.microbatch import Microbatch
from parallel.context_parallel import block_attention, chunk_indices, context_parallel_hooks, cut_microbatch
from parallel.state import ParallelState
from tests.conftest import run_ranks

pytestmark = pytest.mark.tier("fast")


def test_chunk_indices_balance_the_causal_triangle():
    # seq 16, cp 4: chunks of 2; rank 1 holds chunks 1 and 6
    assert chunk_indices(16, 4, 1).tolist() == [2, 3, 12, 13]
    held = torch.cat([chunk_indices(16, 4, r) for r in range(4)])
    assert sorted(held.tolist()) == list(range(16))
    # every rank attends to the same number of (query, key) pairs below the diagonal
    work = [int((chunk_indices(16, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1


def test_cut_microbatch_keeps_true_positions_and_masks():
    tokens = torch.tensor([[5, 1, 7, 0, 3, 4, 0, 2]])  # eod id 0
    loss_mask, position_ids, mask = get_batch_masks(tokens, 0, True, True, True)
    mb = Microbatch.of(tokens, tokens, loss_mask, position_ids, mask)
    part = cut_microbatch(mb, 1, 2)  # chunks 1 and 2 of 4: tokens 2, 3, 4, 5
    assert part.tokens.tolist() == [[7, 0, 3, 4]]
    assert part.position_ids.tolist() == position_ids[:, 2:6].tolist()
    assert part.loss_mask.tolist() == loss_mask[:, 2:6].tolist()
    assert float(part.loss_tokens) == float(loss_mask.sum())  # the whole micro-batch's denominator
    # rows: this rank's queries; columns: rank 0's keys (0, 1, 6, 7), then rank 1's (2, 3, 4, 5)
    order = [0, 1, 6, 7, 2, 3, 4, 5]
    assert part.attention_mask is not None and torch.equal(part.attention_mask, mask[:, :, 2:6][..., order])


def test_block_attention_matches_sdpa_and_returns_lse():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 2, 8, 4), torch.randn(2, 3, 1, 8, 4), torch.randn(2, 3, 1, 8, 4)
    out, lse = block_attention(q, k, v, None, True, 0.5)
    expected = F.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q), is_causal=True, scale=0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), -torch.inf)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    # a row that may see nothing: zero output, lse -inf (no NaN)
    nothing = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    out, lse = block_attention(q, k, v, nothing, False, 0.5)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


def _attention_inputs(seq: int, documents: bool) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1)
    s, b, nq, nkv, d = seq, 2, 4, 2, 8
    q, k, v = torch.randn(s, b, nq, d), torch.randn(s, b, nkv, d), torch.randn(s, b, nkv, d)
    grad = torch.randn(s, b, nq * d)
    tokens = torch.randint(1, 9, (b, s))
    tokens[0, 5], tokens[1, 11] = 0, 0  # document ends
    mask = get_batch_masks(tokens, 0, False, False, True)[2] if documents else None
    return q, k, v, grad, mask


def _reference(q, k, v, grad, mask):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    qs, ks, vs = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    out = out.permute(2, 0, 1, 3).reshape(grad.shape)
    out.backward(grad)
    return out, q.grad, k.grad, v.grad


def _ring_rank(rank: int, world_size: int, seq: int, documents: bool) -> None:
    state = ParallelState.create(1, 1, cp_size=world_size)
    q, k, v, grad, mask = _attention_inputs(seq, documents)
    expected = _reference(q, k, v, grad, mask)
    mine = chunk_indices(seq, world_size, rank)
    local = [t.index_select(0, mine).clone().requires_grad_() for t in (q, k, v)]
    local_mask = None
    if mask is not None:
        zeros = torch.zeros(2, seq)
        local_mask = cut_microbatch(Microbatch.of(zeros, zeros, zeros, zeros, mask), rank, world_size).attention_mask
    attention = context_parallel_hooks(state).attention
    assert attention is not None
    out = attention(*local, local_mask)
    out.backward(grad.index_select(0, mine))
    got = (out, *(t.grad for t in local))
    for name, value, want in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(value, want.index_select(0, mine), rtol=1e-5, atol=1e-5, msg=name)
    dist.barrier()


@pytest.mark.parametrize("world_size,documents", [(2, False), (4, False), (4, True)], ids=["cp2", "cp4", "cp4-docs"])
def test_ring_attention_matches_one_process(world_size, documents):
    run_ranks(world_size, _ring_rank, 16, documents, timeout=120.0)
