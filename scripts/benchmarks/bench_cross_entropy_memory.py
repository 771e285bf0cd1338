"""Peak memory of the loss (output projection + cross entropy, forward and backward) on CPU: the model's plain
path (fp32 logits of the whole micro-batch) against the chunked linear cross entropy of model/kernels.

Each case runs in a fresh forked process; its peak is the process's RSS high-water mark (ru_maxrss, exact)
minus its RSS once the inputs exist, so it counts what the loss itself allocates. Large tensors are mmap'ed by
glibc and returned on free, so RSS follows the tensors. Default sizes: GPT-2's vocabulary 50,257 (padded to
50,304), hidden 768, sequence 1024, micro-batch 4, fp32.

    python scripts/benchmarks/bench_cross_entropy_memory.py [--seq 1024] [--micro-batch 4] [--vocab 50257]
        [--hidden 768] [--path torch|triton]

--path torch (default) runs the chunked algorithm with torch ops (what the model runs on a CPU without Triton);
--path triton runs the Triton kernels, on CPU in the interpreter (slow at these sizes).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import resource
import sys
import time

import torch

from model.kernels import reference
from model.kernels.cross_entropy import chunked_linear_cross_entropy

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


def _case(args: argparse.Namespace, chunked: bool, queue: mp.Queue) -> None:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    padded = 128 * math.ceil(args.vocab / 128)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.seq, args.micro_batch, args.hidden, generator=generator).requires_grad_()
    weight = (0.02 * torch.randn(padded, args.hidden, generator=generator)).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.seq, args.micro_batch), generator=generator)
    baseline = rss_bytes()
    started = time.perf_counter()
    if chunked:
        loss = chunked_linear_cross_entropy(hidden, weight, labels, 0, args.vocab, use_triton=args.path == "triton")
    else:
        loss = reference.linear_cross_entropy(hidden, weight, labels, args.vocab)
    loss.mean().backward()
    seconds = time.perf_counter() - started
    assert weight.grad is not None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put((peak - baseline, seconds, float(loss.detach().mean()), float(weight.grad.norm())))


def run_case(args: argparse.Namespace, chunked: bool) -> tuple[int, float, float, float]:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_case, args=(args, chunked, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--path", choices=("torch", "triton"), default="torch")
    args = parser.parse_args()
    if args.path == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    tokens = args.seq * args.micro_batch
    logits_bytes = tokens * args.vocab * 4
    print(
        f"loss of [{args.seq} x {args.micro_batch}] tokens, hidden {args.hidden}, vocabulary {args.vocab}: "
        f"fp32 logits = {logits_bytes / 2**20:,.1f} MiB"
    )
    plain = run_case(args, chunked=False)
    chunked = run_case(args, chunked=True)
    path = (
        "Triton kernels" + (" (interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else "")
        if args.path == "triton"
        else "torch ops (the chunked torch path)"
    )
    print(f"{'case':<44} {'peak MiB':>10} {'seconds':>8} {'mean loss':>10} {'|dW|':>10}")
    print(
        f"{'plain: full fp32 logits + F.cross_entropy':<44} {plain[0] / 2**20:>10,.1f} {plain[1]:>8.2f} "
        f"{plain[2]:>10.5f} {plain[3]:>10.5f}"
    )
    print(
        f"{'chunked linear cross entropy':<44} {chunked[0] / 2**20:>10,.1f} {chunked[1]:>8.2f} "
        f"{chunked[2]:>10.5f} {chunked[3]:>10.5f}"
    )
    saved = plain[0] - chunked[0]
    print(
        f"chunked path ran on {path}; peak saved {saved / 2**20:,.1f} MiB = {saved / logits_bytes:.2f} x the "
        f"fp32 logits ({'>=' if saved >= logits_bytes else '<'} 1x)"
    )
    return 0 if saved >= logits_bytes else 1


if __name__ == "__main__":
    sys.exit(main())
