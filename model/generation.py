"""Autoregressive generation with a KV cache: logits processing (as transformers orders it) and the loop.

The loop is independent of parallelism: it calls `logits_fn(tokens [1, s], position_ids [1, s], cache)`,
which returns the full-vocabulary logits [1, s, V] of those tokens (under tensor parallelism the caller
gathers the vocabulary shards). The prompt goes through in one forward (prefill); each new token then
costs one token's forward against the cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from model.kv_cache import KVCache

LogitsFn = Callable[[torch.Tensor, torch.Tensor, KVCache], torch.Tensor]


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. greedy: argmax (the other fields but the repetition penalty unused)."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off; > 1 discourages tokens already in the sequence

    def validate(self) -> None:
        """Raise ValueError naming the option when a value is out of range."""
        # `not x > 0` rather than `x <= 0`: NaN fails every comparison and would pass the latter
        if not 0 < self.temperature < math.inf:
            raise ValueError(f"--temperature={self.temperature} must be a number > 0 (use --greedy for argmax)")
        if self.top_k < 0:
            raise ValueError(f"--top-k={self.top_k} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p={self.top_p} must be in (0, 1]")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"--repetition-penalty={self.repetition_penalty} must be a number > 0")


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty (transformers' RepetitionPenaltyLogitsProcessor): the logit of every token in `seen`
    [b, t] is divided by `penalty` when positive, multiplied when negative. logits [b, V]."""
    scores = logits.gather(1, seen)
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(1, seen, scores)


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the k highest logits of each row (ties at the k-th value kept), the rest -inf."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of most likely tokens whose probability reaches top_p
    (the most likely token always stays)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
    remove_sorted = mass_before >= top_p
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def next_token(
    logits: torch.Tensor, seen: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
) -> torch.Tensor:
    """The next token ids [b] from the last position's logits [b, V] (fp32) and the ids so far [b, t]."""
    logits = logits.float()
    if sampling.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, sampling.repetition_penalty)
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = apply_top_p(apply_top_k(logits / sampling.temperature, sampling.top_k), sampling.top_p)
    probs = logits.softmax(dim=-1)
    # Sample on the CPU generator so that --seed gives the same text on every device.
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def generate_tokens(
    logits_fn: LogitsFn,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    eod_id: int | None,
    device: torch.device,
    generator: torch.Generator | None = None,
    max_length: int | None = None,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` new token ids after `prompt_ids`, stopping after EOD (not yielded).

    max_length: the longest sequence the model accepts (learned positions); the cache is sized to
    min(prompt + new tokens, max_length) and generation stops there.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token (e.g. the end-of-document token)")
    total = len(prompt_ids) + max_new_tokens
    if max_length is not None:
        if len(prompt_ids) >= max_length:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens and the model reads at most {max_length} positions: "
                f"shorten it to at most {max_length - 1} tokens, so that a new token fits"
            )
        total = min(total, max_length)
    cache = KVCache(total)
    seen = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, t]
    tokens = seen
    for _ in range(total - len(prompt_ids)):
        start = cache.length
        positions = torch.arange(start, start + tokens.shape[1], device=device)[None, :]
        with torch.no_grad():
            logits = logits_fn(tokens, positions, cache)[:, -1, :]  # [1, V]
        token = next_token(logits, seen, sampling, generator)  # [1]
        if eod_id is not None and int(token) == eod_id:
            return
        yield int(token)
        tokens = token[:, None]
        seen = torch.cat([seen, tokens], dim=1)
