"""Micro-benchmark of every fused kernel against eager torch (its reference): forward + backward time (best of
--repeats after a warm-up) and, on CUDA, the peak memory allocated during the call.

    python scripts/benchmarks/bench_kernels.py [--tokens 8192] [--hidden 2048] [--heads 16] [--vocab 50257]
        [--dtype bf16] [--repeats 20]

On CUDA the kernels run compiled; on CPU only under TRITON_INTERPRET=1 (the interpreter: correct, not fast; the
CPU run checks that the benchmark works, its times mean nothing).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from model.kernels import reference
from model.kernels.backend import backend_name
from model.kernels.cross_entropy import chunked_linear_cross_entropy
from model.kernels.registry import register_kernel_ops
from model.precision import precision_dtype


def measure(fn: Callable[[], torch.Tensor], repeats: int, device: torch.device) -> tuple[float, float]:
    """(best ms of forward + backward, peak MiB allocated during one call; NaN off CUDA)."""

    def once() -> None:
        out = fn()
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward([o.float().sum() for o in outs])

    once()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - started) * 1e3)
    peak = float("nan")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        once()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return best, peak


def cases(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """name -> (fused fn, reference fn) on fresh leaf tensors."""
    s, b, h = args.tokens // 4, 4, args.hidden
    ffn, d = 4 * h, h // args.heads
    ops = register_kernel_ops()  # the fused ops, registered as a model build does

    def leaf(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device=device)).to(dtype).requires_grad_()

    x, w, bias = leaf(s, b, h), (1 + 0.1 * torch.randn(h, device=device)).to(dtype).requires_grad_(), leaf(h)
    y_ffn, b_ffn = leaf(s, b, ffn), leaf(ffn)
    y_glu, b_glu = leaf(s, b, 2 * ffn), leaf(2 * ffn)
    residual = leaf(s, b, h)
    q, k = leaf(s, b, args.heads, d), leaf(s, b, args.heads, d)
    angles = torch.rand(s, b, 1, d, device=device) * 6.28
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    vocab_padded = 128 * -(-args.vocab // 128)
    out_w = leaf(vocab_padded, h, scale=0.02)
    labels = torch.randint(0, args.vocab, (s, b), device=device)
    return {
        "layer_norm": (lambda: ops.norm(x, w, bias, 1e-5, False), lambda: reference.layer_norm(x, w, bias, 1e-5)),
        "rms_norm": (lambda: ops.norm(x, w, None, 1e-5, True), lambda: reference.rms_norm(x, w, 1e-5)),
        "bias_gelu": (lambda: ops.bias_gelu(y_ffn, b_ffn), lambda: reference.bias_gelu(y_ffn, b_ffn)),
        "bias_swiglu": (lambda: ops.bias_swiglu(y_glu, b_glu), lambda: reference.bias_swiglu(y_glu, b_glu)),
        "bias_dropout_add": (
            lambda: ops.bias_dropout_add(x, bias, residual, None),
            lambda: reference.bias_dropout_add(x, bias, residual, lambda t: t),
        ),
        "rotary_qk": (
            lambda: ops.rotary_qk(q, k, cos, sin),
            lambda: (reference.apply_rotary(q, cos, sin), reference.apply_rotary(k, cos, sin)),
        ),
        "linear_cross_entropy": (
            lambda: chunked_linear_cross_entropy(x, out_w, labels, 0, args.vocab, use_triton=True),
            lambda: reference.linear_cross_entropy(x, out_w, labels, args.vocab),
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per call (s x b, b = 4)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = precision_dtype(args.dtype)
    path = backend_name(device)
    if path == "torch":
        print("no Triton on this device (set TRITON_INTERPRET=1 on a CPU): nothing to measure")
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"kernels via {path} on {name}, {args.dtype}, {args.tokens} tokens, hidden {args.hidden}, "
        f"vocab {args.vocab}; best of {args.repeats}, forward + backward"
    )
    print(f"{'kernel':<22} {'eager ms':>9} {'fused ms':>9} {'speed-up':>9} {'eager MiB':>10} {'fused MiB':>10}")
    for kernel, (fused, eager) in cases(args, device, dtype).items():
        eager_ms, eager_mib = measure(eager, args.repeats, device)
        fused_ms, fused_mib = measure(fused, args.repeats, device)
        print(
            f"{kernel:<22} {eager_ms:>9.3f} {fused_ms:>9.3f} {eager_ms / fused_ms:>8.2f}x "
            f"{eager_mib:>10.1f} {fused_mib:>10.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
