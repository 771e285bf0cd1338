"""Model FLOPs per iteration, counted as Megatron-LM and the paper do."""

from __future__ import annotations


def flops_per_iteration(
    batch_size: int, seq_length: int, num_layers: int, hidden_size: int, vocab_size: int, full_recompute: bool = False
) -> float:
    """Training FLOPs of one iteration of a global batch.

    Without recomputation: 72 B s l h^2 (1 + s/6h + V/12lh) (forward + backward = 3 x forward).
    With full recomputation, the paper's equation (3): 96 B s l h^2 (1 + s/6h + V/16lh) (one more forward).
    """
    b, s, l, h, v = batch_size, seq_length, num_layers, hidden_size, vocab_size  # noqa: E741 (the paper's l)
    if full_recompute:
        return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
    return 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))
