"""32 ranks under torchrun on one machine, against one process: the launch path at scale (issue 45).

    python scripts/benchmarks/bench_32_ranks_torchrun.py [--dir runs/bench_32_ranks] [--iterations 5]

Trains configs/gpt_tiny.yaml at a tiny size (8 layers, hidden 32, sequence 32, fp32, dropout 0) on the bundled
sample corpus for `--iterations` iterations twice: on one process, then as `torchrun --nproc-per-node 32` at
tp2 x pp4 x vp2 x dp4 with the interleaved schedule and the distributed optimizer (32 new interpreters, each
importing torch). Prints each run's wall time and tools/compare_runs.py's verdict (every iteration's lm_loss and
grad_norm within 1e-5 of one process); exit status 0 when they agree. The same layout runs on the tests' rank
pool in tests/e2e/test_scale.py (the full tier); this script is the torchrun launch of it, which costs about 3
CPU minutes on two cores (32 x torch's import) and tells little more than the 4-rank torchrun tests do, so it
is measured here rather than in every CI run. Figures: docs/performance.md, "32 ranks on the CPU".
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD_SIZE = 32
MODEL = (
    "model.num_layers=8",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.seq_length=32",
    "model.hidden_dropout=0.0",
    "model.attention_dropout=0.0",
    "train.micro_batch_size=2",
    "train.global_batch_size=32",
    "train.eval_iters=0",
    "train.precision=fp32",
    "checkpoint.save=false",
    "logging.log_interval=1",
    "logging.tensorboard=false",
    "data.num_workers=0",
    "optim.lr_warmup_iters=2",
)
LAYOUT = (
    "parallel.tp_size=2",
    "parallel.pp_size=4",
    "parallel.vp_size=2",
    "parallel.schedule=interleaved",
    "parallel.distributed_optimizer=true",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(command: list[str], run_dir: str, iterations: int, *extra: str) -> float:
    """Wall seconds of one training run (its output on failure, then exit)."""
    args = ["--config", "configs/gpt_tiny.yaml", *MODEL, f"train.train_iters={iterations}", f"run.dir={run_dir}"]
    started = time.perf_counter()
    proc = subprocess.run([*command, "pretrain_gpt.py", *args, *extra], cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{run_dir}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="runs/bench_32_ranks")
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    env_note = "OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "(unset)")
    one = train([sys.executable], os.path.join(args.dir, "one_process"), args.iterations)
    launcher = shutil.which("torchrun")
    torchrun = [launcher] if launcher else [sys.executable, "-m", "torch.distributed.run"]
    torchrun += ["--nnodes", "1", "--nproc-per-node", str(WORLD_SIZE)]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    many = train(torchrun, os.path.join(args.dir, "torchrun_32"), args.iterations, *LAYOUT)
    print(f"one process: {one:.1f} s; torchrun, 32 ranks (tp2 x pp4 x vp2 x dp4): {many:.1f} s ({env_note})")
    compare = [sys.executable, os.path.join(REPO_ROOT, "tools", "compare_runs.py")]
    compare += [os.path.join(args.dir, "one_process"), os.path.join(args.dir, "torchrun_32"), "--strict-iters", "-1"]
    compare += ["--key", "lm_loss", "--key", "grad_norm"]
    return subprocess.run(compare).returncode


if __name__ == "__main__":
    sys.exit(main())
