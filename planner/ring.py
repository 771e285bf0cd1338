"""Communication of context parallelism's ring attention (parallel/context_parallel.py), per layer and
micro-batch, as bytes each rank sends, and the time of the part the block attention does not hide.

Forward: the key/value block of s/cp tokens (k and v of the rank's query groups, [2, s/cp, b, g/tp, d]) goes
once around the ring minus one hop (cp - 1 sends). Backward: the blocks go around again (cp - 1 sends) and each
block's gradient, the same size, makes a full turn (cp sends). Each send overlaps one block's attention.
"""

from __future__ import annotations

from typing import Any


def kv_block_bytes(model: Any, micro_batch: int, tp_size: int, cp_size: int, value_bytes: int) -> float:
    """Bytes of one rank's key/value block: 2 x (s/cp) x b x (query groups / tp) x head_dim values."""
    local = model.seq_length // cp_size
    return 2.0 * local * micro_batch * (model.query_groups / tp_size) * model.head_dim * value_bytes


def ring_bytes_per_layer(
    model: Any, micro_batch: int, tp_size: int, cp_size: int, value_bytes: int
) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends per layer and micro-batch (0 without context parallelism)."""
    if cp_size == 1:
        return 0.0, 0.0
    block = kv_block_bytes(model, micro_batch, tp_size, cp_size, value_bytes)
    return (cp_size - 1) * block, (2 * cp_size - 1) * block


def exposed_ring_seconds(send_seconds: float, block_attention_seconds: float, sends: int) -> float:
    """Time the ring adds: each of `sends` transfers (send_seconds each) runs while one block is attended to,
    so only what a transfer takes beyond that block's attention shows."""
    return sends * max(0.0, send_seconds - block_attention_seconds)
