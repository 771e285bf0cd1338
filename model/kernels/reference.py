"""Plain-torch references of the fused operations: the semantics each kernel must reproduce, and the path the
model takes when a kernel is switched off (so the default behaviour is the model's original code)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def bias_gelu(y: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """gelu(y + bias): [..., F] -> [..., F]; exact (erf) GeLU, or GPT-2's tanh form with approximate="tanh"."""
    return F.gelu(y if bias is None else y + bias, approximate=approximate)


def bias_swiglu(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up with [gate, up] = y + bias: [..., 2F] -> [..., F]."""
    gate, up = (y if bias is None else y + bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def bias_dropout_add(
    y: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    dropout: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """residual + dropout(y + bias)."""
    return residual + dropout(y if bias is None else y + bias)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [s, b, n, d] by the position angles cos, sin [s, b, 1, d] (rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def cross_entropy_per_token(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token loss in fp32: logits [s, b, V], labels [s, b] -> [s, b]."""
    s, b, vocab = logits.shape
    loss = F.cross_entropy(logits.float().view(-1, vocab), labels.reshape(-1), reduction="none")
    return loss.view(s, b)


def mask_vocab_padding(logits: torch.Tensor, num_valid: int) -> torch.Tensor:
    """Columns >= num_valid (vocabulary padding) never score: filled with the dtype's lowest value."""
    if num_valid >= logits.shape[-1]:
        return logits
    padding = torch.arange(logits.shape[-1], device=logits.device) >= num_valid
    return logits.masked_fill(padding, torch.finfo(logits.dtype).min)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, num_valid: int | None = None
) -> torch.Tensor:
    """Per-token loss [s, b] of the full logits hidden [s, b, h] @ weight [V, h]^T (one process)."""
    logits = F.linear(hidden, weight)
    return cross_entropy_per_token(
        mask_vocab_padding(logits, weight.shape[0] if num_valid is None else num_valid), labels
    )


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The experts' grouped matrix multiply as a per-expert loop: x [P, K] in E consecutive groups of
    tokens_per_expert [E] rows, weights [E, N, K] (nn.Linear's layout per expert) -> [P, N], group e
    multiplied by weights[e].T with one torch.mm each (reads the counts on the host: a sync on a GPU)."""
    groups = torch.split(x, tokens_per_expert.tolist())
    return torch.cat([group @ weight.T for group, weight in zip(groups, weights)])
