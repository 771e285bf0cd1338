"""Keys and values kept between forward calls, so that generating one token costs one token's forward.

`GPTModel.forward(..., kv_cache=cache)` hands each layer `cache.layer(layer_id)`; the layer's attention
appends its new keys/values ([s_new, b, groups_local, d], this tensor-parallel rank's query groups) and
attends over everything cached so far. The caller passes position ids that continue where the cache ends
(`cache.length`). Buffers are allocated once, at the first call, for `max_length` tokens.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """One layer's keys and values: buffers [max_length, b, groups_local, d], filled up to `length`."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Append k, v [s_new, b, g, d]; return all keys and values [length, b, g, d] and the attention mask
        for the new queries: None (plain causal) when the cache was empty, else bool [s_new, length] with
        True = may attend (query i sits at position start + i)."""
        start, s_new = self.length, k.shape[0]
        if start + s_new > self.max_length:
            raise ValueError(f"KV cache holds {self.max_length} tokens; {start} + {s_new} do not fit")
        if self.keys is None or self.values is None:
            self.keys = k.new_empty((self.max_length, *k.shape[1:]))
            self.values = v.new_empty((self.max_length, *v.shape[1:]))
        keys, values = self.keys, self.values
        keys[start : start + s_new] = k
        values[start : start + s_new] = v
        self.length = start + s_new
        mask = None
        if start > 0:
            query_pos = torch.arange(start, self.length, device=k.device)[:, None]
            mask = torch.arange(self.length, device=k.device)[None, :] <= query_pos  # [s_new, length]
        return keys[: self.length], values[: self.length], mask


class KVCache:
    """The caches of every layer of a model (or of this rank's layers), keyed by global layer index."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.layers: dict[int, LayerKVCache] = {}

    def layer(self, layer_id: int) -> LayerKVCache:
        """The cache of global layer `layer_id` (created empty on first use)."""
        if layer_id not in self.layers:
            self.layers[layer_id] = LayerKVCache(self.max_length)
        return self.layers[layer_id]

    @property
    def length(self) -> int:
        """Tokens cached so far (the position of the next token)."""
        return max((cache.length for cache in self.layers.values()), default=0)
