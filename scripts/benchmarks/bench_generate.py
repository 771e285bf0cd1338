"""Time per generated token at a short and a long context, with the KV cache and without it.

With the cache each new token costs one token's forward (plus attention over the cached keys), so the time
per token stays nearly flat as the context grows; without it every step re-runs the whole sequence.

    python scripts/benchmarks/bench_generate.py [--contexts 32 512] [--tokens 32] [--repeats 3] [--device cpu]
"""

import argparse
import time

import torch
from bench_models import model_config, tied_gpt

from model.gpt import GPTModel
from model.kv_cache import KVCache


def build(args: argparse.Namespace) -> GPTModel:
    cfg = model_config(args.layers, args.hidden, args.heads, max(args.contexts) + args.tokens, vocab_size=50257)
    return tied_gpt(cfg, seed=0, device=args.device).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def ms_per_token(model: GPTModel, context: int, new_tokens: int, use_cache: bool, device: str) -> float:
    """Milliseconds per new token after a prefill of `context` tokens (the prefill itself not timed)."""
    tokens = torch.randint(0, 50257, (1, context), device=device)
    cache = KVCache(context + new_tokens) if use_cache else None
    model(tokens, torch.arange(context, device=device)[None], kv_cache=cache)
    sync(device)
    started = time.perf_counter()
    for step in range(new_tokens):
        position = context + step
        if use_cache:
            model(tokens[:, -1:], torch.tensor([[position]], device=device), kv_cache=cache)
        else:
            model(tokens, torch.arange(position, device=device)[None])
            tokens = torch.cat([tokens, tokens[:, -1:]], dim=1)
    sync(device)
    return 1000 * (time.perf_counter() - started) / new_tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", type=int, nargs="+", default=[32, 512])
    p.add_argument("--tokens", type=int, default=16, help="new tokens timed per measurement")
    p.add_argument("--repeats", type=int, default=3, help="best of this many measurements")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    model = build(args)
    print(
        f"GPT {args.layers} layers, hidden {args.hidden}, vocab 50257, fp32, {args.device}, "
        f"{torch.get_num_threads()} threads; best of {args.repeats}",
        flush=True,
    )
    for context in args.contexts:
        cached = min(ms_per_token(model, context, args.tokens, True, args.device) for _ in range(args.repeats))
        full = min(ms_per_token(model, context, args.tokens, False, args.device) for _ in range(args.repeats))
        print(
            f"context {context:5d}: {cached:8.2f} ms/token with the KV cache, {full:8.2f} ms/token without", flush=True
        )


if __name__ == "__main__":
    main()
