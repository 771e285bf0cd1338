"""Steady-state training throughput of the real trainer with fused kernels off/on and torch.compile off/on.

Each case runs `pretrain_gpt.py` in a fresh process (no compile cache or allocator state carried over) for
--iters iterations without evaluation or checkpoints, and reads its metrics.jsonl: the median ms/iteration of
the iterations after --warmup (compilation and allocator warm-up happen there), tokens/s, the paper's achieved
TFLOP/s (recomputation included; FLOPs from model/shape.py) and MFU (model FLOPs, recomputation excluded, over
the peak: --peak-tflops, passed on as logging.peak_tflops, or the trainer's known peak of the GPU).

    python scripts/benchmarks/bench_train_throughput.py [--config configs/gpt_tiny.yaml] [--iters 30]
        [--warmup 5] [--kernels off,on] [--compile off,on] [--micro-batch auto|N,N,...] [--peak-tflops T]
        [override ...]

--micro-batch 32,16,8 tries each (largest first) with the first case until one runs without running out of
memory, then keeps it for every case (global batch = 4 x micro-batch). Overrides are `section.key=value`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_models import REPO_ROOT, trainer_argv


def run_trainer(config: str, overrides: list[str], iters: int, run_dir: str) -> tuple[int, str, list[dict]]:
    """(exit code, output tail, training records) of one trainer run."""
    argv = trainer_argv([sys.executable], ["--config", config, *overrides], iters, run_dir)
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    records = []
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if proc.returncode == 0 and os.path.exists(metrics):
        with open(metrics, encoding="utf-8") as handle:
            records = [r for r in map(json.loads, handle) if "lm_loss" in r]
    return proc.returncode, output[-3000:], records


def summarize(records: list[dict], warmup: int) -> dict:
    steady = [r for r in records if r["iteration"] > warmup] or records
    ms = statistics.median(r["ms_per_iter"] for r in steady)
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]  # None without a known peak
    return {
        "ms": ms,
        "tokens_per_s": statistics.median(r["tokens_per_sec"] for r in steady),
        "tflops": statistics.median(r["tflops_per_device"] for r in steady),
        "mfu": statistics.median(mfus) if mfus else None,
        "first_ms": records[0]["ms_per_iter"],
        "loss": records[-1]["lm_loss"],
    }


def is_out_of_memory(output: str) -> bool:
    return "out of memory" in output.lower() or "OutOfMemoryError" in output


def pick_micro_batch(args: argparse.Namespace, candidates: list[int], first_case: list[str]) -> int:
    """The largest candidate micro-batch whose run does not run out of memory."""
    for micro in candidates:
        with tempfile.TemporaryDirectory() as run_dir:
            code, output, _ = run_trainer(
                args.config, [*args.overrides, *first_case, *batch_overrides(micro)], args.warmup + 2, run_dir
            )
        if code == 0:
            return micro
        if not is_out_of_memory(output):
            raise SystemExit(f"micro-batch {micro}: the trainer failed (not out of memory):\n{output}")
        print(f"micro-batch {micro}: out of memory", flush=True)
    raise SystemExit(f"no micro-batch of {candidates} fits")


def batch_overrides(micro: int) -> list[str]:
    return [f"train.micro_batch_size={micro}", f"train.global_batch_size={4 * micro}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(REPO_ROOT, "configs", "gpt_tiny.yaml"))
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--kernels", default="off", help="off, on or off,on")
    parser.add_argument("--compile", default="off,on", help="off, on or off,on")
    parser.add_argument("--micro-batch", default=None, help="N, or N,N,... tried largest first")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak, for MFU (default: known)")
    parser.add_argument("--label", default="", help="printed in front of each row")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    cases = [(k, c) for k in args.kernels.split(",") for c in args.compile.split(",")]
    as_overrides = {
        (k, c): [
            f"model.fused_kernels={'true' if k == 'on' else 'false'}",
            f"train.compile={'true' if c == 'on' else 'false'}",
        ]
        for k, c in cases
    }
    micro_overrides: list[str] = [] if args.peak_tflops is None else [f"logging.peak_tflops={args.peak_tflops}"]
    if args.micro_batch:
        candidates = sorted((int(m) for m in args.micro_batch.split(",")), reverse=True)
        micro = candidates[0] if len(candidates) == 1 else pick_micro_batch(args, candidates, as_overrides[cases[0]])
        micro_overrides += batch_overrides(micro)
        print(f"micro-batch {micro}", flush=True)
    print(
        f"{'case':<40} {'ms/iter':>9} {'1st iter ms':>11} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'last loss':>9}",
        flush=True,
    )
    for case in cases:
        with tempfile.TemporaryDirectory() as run_dir:
            code, output, records = run_trainer(
                args.config, [*args.overrides, *micro_overrides, *as_overrides[case]], args.iters, run_dir
            )
        name = f"{args.label}kernels {case[0]}, compile {case[1]}"
        if code != 0 or not records:
            print(f"{name:<40} FAILED (exit {code}):\n{output}", flush=True)
            return 1
        row = summarize(records, args.warmup)
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
        print(
            f"{name:<40} {row['ms']:>9.1f} {row['first_ms']:>11.1f} {row['tokens_per_s']:>10.0f} "
            f"{row['tflops']:>8.3f} {mfu:>6} {row['loss']:>9.4f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
