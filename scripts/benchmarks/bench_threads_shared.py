"""The trainer's default thread count on a shared machine: ms/iteration idle and next to one busy process.

Runs the default config (`python pretrain_gpt.py`, no thread setting: OMP_NUM_THREADS, OMP_WAIT_POLICY and
GOMP_SPINCOUNT are removed from the environment, so the trainer's own choices apply) --iters iterations, idle and
then with one competing busy process (a Python loop spinning on one core, started --settle seconds before the
run), --rounds times each, alternating, and prints the median ms/iteration after --warmup of each run and the
ratio busy / idle of the best round of each. Other choices can be compared with --case NAME=ENV_OR_OVERRIDE,...
(for example `one=train.num_threads=1`, or `spin=OMP_WAIT_POLICY=`: an empty value keeps the trainer from
choosing the wait, so libgomp spins as it does by default; an upper-case KEY=VALUE is an environment variable).

    python scripts/benchmarks/bench_threads_shared.py [--iters 20] [--warmup 5] [--rounds 3]
        [--case one=train.num_threads=1 ...]

Acceptance (issues 33 and 40): with one competing busy process the default run takes at most 2x its idle
ms/iteration, with the thread count fixed by the topology (all cores // local ranks, whatever the load: the
numerics must not depend on it), against spinning threads (`--case spin=OMP_WAIT_POLICY=`). Run it on an
otherwise idle machine (`uptime` load < 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_models import REPO_ROOT
from bench_train_throughput import run_trainer

sys.path.insert(0, REPO_ROOT)
from operations.threads import usable_cores

BUSY_LOOP = "while True: pass"


def parse_case(text: str) -> tuple[str, dict[str, str], list[str]]:
    """NAME=A=B,C=D -> (NAME, environment additions, trainer overrides)."""
    name, _, settings = text.partition("=")
    env, overrides = {}, []
    for setting in filter(None, settings.split(",")):
        key, _, value = setting.partition("=")
        if key.isupper():
            env[key] = value
        else:
            overrides.append(setting)
    return name, env, overrides


def one_run(env_extra: dict, overrides: list[str], args, busy: bool) -> float:
    """Median ms/iteration after the warm-up of one trainer run, optionally next to one busy process."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_extra)
    competitor = subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) if busy else None
    try:
        if competitor is not None:
            time.sleep(args.settle)
        with tempfile.TemporaryDirectory() as run_dir:
            saved = os.environ.copy()
            os.environ.clear()
            os.environ.update(env)
            try:
                code, output, records = run_trainer(args.config, overrides, args.iters, run_dir)
            finally:
                os.environ.clear()
                os.environ.update(saved)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    if code != 0:
        raise SystemExit(f"the trainer failed (exit {code}):\n{output}")
    thread_lines = [line for line in output.splitlines() if " per rank (" in line]
    if thread_lines and args.verbose:
        print("   ", thread_lines[0].strip())
    return statistics.median(r["ms_per_iter"] for r in records if r["iteration"] > args.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/gpt_tiny.yaml")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds the busy process runs before the trainer")
    parser.add_argument("--case", action="append", default=[], help="NAME=KEY=VALUE,... (see above)")
    parser.add_argument("--verbose", action="store_true", help="print each run's thread line")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"{usable_cores()} usable cores; load average {load:.2f} (an idle machine reads < 1)")
    cases: list[tuple[str, dict[str, str], list[str]]] = [("default", {}, [])] + [
        parse_case(text) for text in args.case
    ]
    print(f"{'case':>12} | {'idle ms/iter (best; rounds)':>36} | {'busy ms/iter (best; rounds)':>36} | busy/idle")
    for name, env, overrides in cases:
        idle, busy = [], []
        for _ in range(args.rounds):
            idle.append(one_run(env, overrides, args, busy=False))
            busy.append(one_run(env, overrides, args, busy=True))
        rounds = [", ".join(f"{value:.0f}" for value in values) for values in (idle, busy)]
        print(
            f"{name:>12} | {min(idle):8.1f} ({rounds[0]:>24}) | {min(busy):8.1f} ({rounds[1]:>24}) | "
            f"{min(busy) / min(idle):.2f}x"
        )


if __name__ == "__main__":
    main()
