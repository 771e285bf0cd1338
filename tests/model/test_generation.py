"""KV-cache decoding equals the full forward; logits processing equals transformers' processors."""

import pytest
import torch

from model.generation import (
    SamplingConfig,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    generate_tokens,
    next_token,
)
from model.gpt import GPTModel
from model.init import initialize_parameters
from model.kv_cache import KVCache
from tests.tiny_models import tiny_config

pytestmark = pytest.mark.tier("fast")


def tiny_model(style: str = "gpt") -> GPTModel:
    cfg = tiny_config(style, seq_length=40, make_vocab_size_divisible_by=8)
    with torch.device("meta"):
        model = GPTModel(cfg, cfg.padded_vocab_size())
    initialize_parameters(model, cfg, seed=3)
    return model.eval()


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_cached_decoding_equals_the_full_forward(style):
    model = tiny_model(style)
    tokens = torch.randint(0, 50, (2, 30))
    positions = torch.arange(30).expand(2, 30)
    with torch.no_grad():
        full = model(tokens, positions)
        cache = KVCache(30)
        pieces = [model(tokens[:, :12], positions[:, :12], kv_cache=cache)]  # prefill
        pieces.append(model(tokens[:, 12:15], positions[:, 12:15], kv_cache=cache))  # several at once
        for i in range(15, 30):  # one token at a time
            pieces.append(model(tokens[:, i : i + 1], positions[:, i : i + 1], kv_cache=cache))
    assert cache.length == 30
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)


def test_cache_refuses_overflow():
    cache = KVCache(4)
    k = torch.zeros(3, 1, 2, 8)
    cache.layer(0).update(k, k)
    with pytest.raises(ValueError, match="KV cache holds 4 tokens; 3 \\+ 3 do not fit"):
        cache.layer(0).update(k, k)


def test_logits_processing_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(3, 100) * 3
    seen = torch.randint(0, 100, (3, 7))
    torch.testing.assert_close(
        apply_repetition_penalty(logits, seen, 1.3), RepetitionPenaltyLogitsProcessor(1.3)(seen, logits.clone())
    )
    torch.testing.assert_close(apply_top_k(logits, 10), TopKLogitsWarper(10)(seen, logits.clone()))
    for top_p in (0.3, 0.9):
        torch.testing.assert_close(apply_top_p(logits, top_p), TopPLogitsWarper(top_p)(seen, logits.clone()))


def test_sampling_is_seeded_and_greedy_is_argmax():
    torch.manual_seed(0)
    logits, seen = torch.randn(1, 100), torch.zeros(1, 1, dtype=torch.long)
    sampling = SamplingConfig(temperature=0.7, top_k=20, top_p=0.9)
    draws = [int(next_token(logits, seen, sampling, torch.Generator().manual_seed(5))) for _ in range(2)]
    assert draws[0] == draws[1]
    assert int(next_token(logits, seen, SamplingConfig(greedy=True), None)) == int(logits.argmax())
    with pytest.raises(ValueError, match="--top-p=1.5 must be in"):
        SamplingConfig(top_p=1.5).validate()


def test_generation_stops_at_eod_and_at_the_position_limit():
    model = tiny_model()

    def logits_fn(tokens, positions, cache):
        return model(tokens, positions, kv_cache=cache)[..., :50]

    greedy = SamplingConfig(greedy=True)
    free = list(generate_tokens(logits_fn, [1, 2, 3], 100, greedy, None, torch.device("cpu"), max_length=40))
    assert len(free) == 37  # 40 positions
    stop = free[5]
    stopped = list(generate_tokens(logits_fn, [1, 2, 3], 100, greedy, stop, torch.device("cpu"), max_length=40))
    assert stopped == free[: free.index(stop)]
