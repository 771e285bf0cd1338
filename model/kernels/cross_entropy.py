"""Output projection + cross entropy, chunk by chunk over tokens: the fp32 logits of the whole micro-batch
([s*b, V] x 4 bytes, 823 MB for GPT-2's vocabulary at s=1024, b=4) never exist, only one chunk's.

Forward, per chunk of C tokens: logits = hidden_c @ W^T (the input dtype; fp32 for the statistics), then per
token the max, the sum of exp(logit - max) and the target's logit. Vocabulary-parallel (W split by rows over
tp): each rank's statistics are combined with three reductions of [s*b] fp32 tensors after the last chunk,
injected as callables (`CrossEntropyReductions`; model/ knows nothing of torch.distributed), the same three
all-reduces as parallel/tp_layers.vocab_parallel_cross_entropy. loss = logsumexp - target logit.

Backward recomputes each chunk's logits (one more output-layer GEMM, the price of not storing them) and turns
them in place into grad_loss * (softmax - onehot), then dhidden_c = grad @ W and dW += grad^T @ hidden_c.
The per-chunk statistics and the gradient run in Triton where Triton runs, else in torch (same algorithm).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from model.kernels.backend import triton_kernels


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class CrossEntropyReductions(NamedTuple):
    """All-reduces over the vocabulary shards of [N] fp32 tensors; identities on one shard."""

    max: Callable[[torch.Tensor], torch.Tensor] = _identity
    sum: Callable[[torch.Tensor], torch.Tensor] = _identity


def default_chunk_tokens(n_tokens: int, hidden: int, vocab_local: int) -> int:
    """Tokens per chunk so that a chunk's logits hold about as many numbers as the hidden input [N, h]."""
    return max(1, math.ceil(n_tokens / math.ceil(vocab_local / hidden)))


# ---- per-chunk statistics and gradient: torch version ----------------------------------------------------
def _mask_padding_(logits: torch.Tensor, num_valid: int) -> None:
    if num_valid < logits.shape[-1]:
        logits[:, max(num_valid, 0) :] = float("-inf")


def owned_target(target: torch.Tensor, vocab_start: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target's column in this vocabulary shard [vocab_start, vocab_start + vocab_local), clamped into it
    where the shard does not hold the target; whether it holds it) for target ids of any shape. Readers of
    the column take their value there and zero it where not owned, so one rank's contribution survives the
    sum over shards."""
    local = target - vocab_start
    owned = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1), owned


def _chunk_stats_torch(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, num_valid: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [C, V] fp32 (overwritten) -> local max, sum exp(logit - local max), target logit (0 if not owned)."""
    _mask_padding_(logits, num_valid)
    row_max = logits.max(dim=-1).values
    safe_max = row_max.masked_fill(row_max == float("-inf"), 0.0)  # a shard of padding only
    local, owned = owned_target(target, vocab_start, logits.shape[-1])
    target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
    sum_exp = logits.sub_(safe_max.unsqueeze(-1)).exp_().sum(dim=-1)
    return row_max, sum_exp, target_logit


def _chunk_grad_torch(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    grad_loss: torch.Tensor,
    vocab_start: int,
    num_valid: int,
) -> None:
    """In place: logits [C, V] fp32 -> grad_loss * (softmax - onehot(target))."""
    _mask_padding_(logits, num_valid)
    grad = logits.sub_(lse.unsqueeze(-1)).exp_()
    local, owned = owned_target(target, vocab_start, logits.shape[-1])
    grad.scatter_add_(-1, local.unsqueeze(-1), -owned.to(grad.dtype).unsqueeze(-1))
    grad.mul_(grad_loss.unsqueeze(-1))


# ---- the same in Triton ----------------------------------------------------------------------------------
def ce_blocks(rows: int, vocab_local: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_R rows, BLOCK_V columns) per program step. Compiled: one row, 1024 columns per step keep three
    fp32 accumulators in registers. Interpreter: its cost is per program and loop trip, so large blocks."""
    tk = triton_kernels()
    if device.type == "cuda":
        return 1, min(tk.next_power_of_2(vocab_local), 1024)
    block_v = min(tk.next_power_of_2(vocab_local), 16384)
    return tk.next_power_of_2(max(1, min(rows, 65536 // block_v))), block_v


def _chunk_stats_triton(logits, target, vocab_start, num_valid):
    tk = triton_kernels()
    rows, vocab_local = logits.shape
    row_max, sum_exp, target_logit = (torch.empty(rows, device=logits.device, dtype=torch.float32) for _ in range(3))
    block_r, block_v = ce_blocks(rows, vocab_local, logits.device)
    tk.ce_chunk_stats[(-(-rows // block_r),)](
        logits,
        target,
        row_max,
        sum_exp,
        target_logit,
        rows,
        vocab_start,
        num_valid,
        V=vocab_local,
        BLOCK_R=block_r,
        BLOCK_V=block_v,
    )
    return row_max, sum_exp, target_logit


def _chunk_grad_triton(logits, target, lse, grad_loss, vocab_start, num_valid):
    tk = triton_kernels()
    rows, vocab_local = logits.shape
    block_r, block_v = ce_blocks(rows, vocab_local, logits.device)
    tk.ce_chunk_grad[(-(-rows // block_r),)](
        logits, target, lse, grad_loss, rows, vocab_start, num_valid, V=vocab_local, BLOCK_R=block_r, BLOCK_V=block_v
    )


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """hidden [s, b, h], weight [V_local, h], labels [s, b] -> per-token loss [s, b] fp32."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        labels,
        vocab_start: int,
        num_valid: int,
        reductions: CrossEntropyReductions,
        chunk_tokens: int,
        use_triton: bool,
    ):
        hidden_2d = hidden.reshape(-1, hidden.shape[-1])  # [N, h]
        target = labels.reshape(-1).contiguous()
        stats_fn = _chunk_stats_triton if use_triton else _chunk_stats_torch
        parts = [
            stats_fn(
                _chunk_logits(hidden_2d, weight, start, chunk_tokens),
                target[start : start + chunk_tokens],
                vocab_start,
                num_valid,
            )
            for start in range(0, target.numel(), chunk_tokens)
        ]
        row_max, sum_exp, target_logit = (torch.cat(column) for column in zip(*parts))
        global_max = reductions.max(row_max.clone())
        # rescale each shard's sum to the global max; a shard with no valid column contributes 0
        sum_exp = reductions.sum(torch.where(row_max == float("-inf"), 0.0, sum_exp * (row_max - global_max).exp()))
        target_logit = reductions.sum(target_logit)
        lse = global_max + sum_exp.log()
        ctx.save_for_backward(hidden_2d, weight, target, lse)
        ctx.meta = (hidden.shape, vocab_start, num_valid, chunk_tokens, use_triton)
        return (lse - target_logit).view(labels.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden_2d, weight, target, lse = ctx.saved_tensors
        hidden_shape, vocab_start, num_valid, chunk_tokens, use_triton = ctx.meta
        grad_fn = _chunk_grad_triton if use_triton else _chunk_grad_torch
        grad_loss = grad_loss.reshape(-1).float().contiguous()
        grad_hidden = torch.empty_like(hidden_2d) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        )
        for start in range(0, target.numel(), chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = _chunk_logits(hidden_2d, weight, start, chunk_tokens)
            grad_fn(logits, target[rows], lse[rows], grad_loss[rows], vocab_start, num_valid)
            grad_logits = logits.to(hidden_2d.dtype)  # [C, V_local]
            if grad_hidden is not None:
                torch.matmul(grad_logits, weight, out=grad_hidden[rows])
            if grad_weight is not None:
                grad_weight += (grad_logits.t() @ hidden_2d[rows]).float()
        grad_hidden = grad_hidden.view(hidden_shape) if grad_hidden is not None else None
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _chunk_logits(hidden_2d: torch.Tensor, weight: torch.Tensor, start: int, chunk_tokens: int) -> torch.Tensor:
    """A fresh contiguous fp32 [C, V_local] tensor of this chunk's logits (safe to overwrite)."""
    logits = hidden_2d[start : start + chunk_tokens] @ weight.t()
    return logits if logits.dtype == torch.float32 else logits.float()


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int = 0,
    num_valid: int | None = None,
    reductions: CrossEntropyReductions | None = None,
    chunk_tokens: int | None = None,
    use_triton: bool = False,
) -> torch.Tensor:
    """Per-token loss [s, b] (fp32) of logits hidden [s, b, h] @ weight [V_local, h]^T without materialising
    them: this rank holds vocabulary ids [vocab_start, vocab_start + V_local); columns >= num_valid (padding)
    never score; `reductions` combine the shards' statistics (identity on one rank)."""
    reductions = reductions if reductions is not None else CrossEntropyReductions()
    vocab_local = weight.shape[0]
    num_valid = vocab_local if num_valid is None else min(num_valid, vocab_local)
    n_tokens = labels.numel()
    chunk_tokens = chunk_tokens or default_chunk_tokens(n_tokens, hidden.shape[-1], vocab_local)
    return ChunkedLinearCrossEntropy.apply(
        hidden, weight, labels, vocab_start, num_valid, reductions, chunk_tokens, use_triton
    )
