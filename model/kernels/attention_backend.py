"""Which backend torch's scaled_dot_product_attention picks for the model's attention (attention stays on SDPA:
flash or memory-efficient on GPUs, the fused flash kernel or the math path on CPU)."""

from __future__ import annotations

import torch

from compat.torch_private import fused_sdp_choice
from model.config import ModelConfig

_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def sdpa_backend(
    cfg: ModelConfig,
    micro_batch_size: int,
    tp_size: int,
    device: torch.device,
    dtype: torch.dtype,
    training: bool = True,
) -> str:
    """The backend SDPA dispatches to for this model's attention call (causal, no explicit mask), asked of
    torch's own selector (a private name: compat/torch_private.py) on small probe tensors of the real head
    shape; 'unknown' if torch cannot say."""
    choose = fused_sdp_choice()
    if choose is None:
        return "unknown"
    heads = max(1, cfg.num_attention_heads // tp_size)
    kv_heads = max(1, cfg.query_groups // tp_size)
    q = torch.empty(micro_batch_size, heads, cfg.seq_length, cfg.head_dim, device=device, dtype=dtype)
    kv = torch.empty(micro_batch_size, kv_heads, cfg.seq_length, cfg.head_dim, device=device, dtype=dtype)
    dropout = cfg.attention_dropout if training else 0.0
    try:
        choice = choose(q, kv, kv, None, dropout, True, enable_gqa=kv_heads != heads)
    except (RuntimeError, TypeError):
        return "unknown"
    return _NAMES.get(int(choice), str(choice))
