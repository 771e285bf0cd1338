"""The planner against this trainer's own CPU runs: calibrate on three layouts, predict three others.

    python scripts/benchmarks/bench_planner_cpu.py [--rounds 2] [--iters 6]

Runs pretrain_gpt.py (torchrun for more than one rank, gloo, one thread per rank) on a small GPT (8 layers,
hidden 256, sequence 256, fp32, global batch 16) in six layouts, each `--rounds` times, and keeps each layout's
best round (the median ms/iteration of its logged iterations after the first): the machine is shared, so the
best round is the least disturbed. `tools/plan.py --calibrate`'s fit (planner/calibrate.py: gemm_max, hbm,
collective_base_us) runs on CALIBRATE; HELD_OUT are predicted with the fitted constants and never seen by the fit.
Prints measured against predicted ms/iteration side by side. Cluster: configs/clusters/cpu_2core.yaml
(ranks share the 2 cores: planner/costs.py `device_share`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench_models import trainer_argv

from config.schema import load_config
from operations.startup import DEFAULT_CONFIG
from planner import calibrate
from planner.cluster import load_cluster

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# compute; the other busy processes the scheduler shares the 2 cores with (pp2 against 1 process tells it);
# gloo's cost per call (tp2 tells it)
FIT_KEYS = ("gemm_max", "competing_processes", "collective_base_us")

MODEL = [
    "model.num_layers=8",
    "model.hidden_size=256",
    "model.num_attention_heads=4",
    "model.seq_length=256",
    "train.micro_batch_size=2",
    "train.global_batch_size=16",
]
# (label, ranks, overrides)
CALIBRATE = [
    ("1 process", 1, []),
    ("tp2", 2, ["parallel.tp_size=2"]),
    ("pp2 (8 micro-batches)", 2, ["parallel.pp_size=2"]),
]
HELD_OUT = [
    ("tp2 x pp2", 4, ["parallel.tp_size=2", "parallel.pp_size=2"]),
    ("pp4 vp2", 4, ["parallel.pp_size=4", "parallel.vp_size=2", "parallel.schedule=interleaved"]),
    (
        "tp2 x pp2 x vp2 x dp2",
        8,
        ["parallel.tp_size=2", "parallel.pp_size=2", "parallel.vp_size=2", "parallel.schedule=interleaved"],
    ),
]


def run_layout(ranks: int, overrides: list[str], iters: int, run_dir: str) -> None:
    """One trainer run writing config.yaml and metrics.jsonl into run_dir."""
    launcher = [sys.executable] if ranks == 1 else ["torchrun", "--standalone", f"--nproc-per-node={ranks}"]
    argv = trainer_argv(launcher, [*MODEL, *overrides], iters, run_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(overrides)} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")


def best_observation(label: str, ranks: int, overrides: list[str], args: argparse.Namespace, tmp: str):
    """The fastest of `rounds` runs as a calibrate.Observation (its world size set from `ranks`)."""
    best = None
    for r in range(args.rounds):
        run_dir = os.path.join(tmp, f"{label.replace(' ', '_')}_{r}")
        run_layout(ranks, overrides, args.iters, run_dir)
        obs = calibrate.load_run(run_dir)
        obs.label, obs.world_size = label, ranks
        print(f"  {label}: round {r + 1}: {obs.measured_seconds * 1e3:.0f} ms/iteration", file=sys.stderr, flush=True)
        if best is None or obs.measured_seconds < best.measured_seconds:
            best = obs
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--cluster", default=os.path.join(REPO_ROOT, "configs", "clusters", "cpu_2core.yaml"))
    parser.add_argument("--save", help="write the measured ms/iteration of every layout here (JSON)")
    parser.add_argument("--load", help="skip measuring: read the ms/iteration --save wrote and fit again")
    args = parser.parse_args()
    if args.load:
        fit_on, held = recorded(args.load)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            fit_on = [best_observation(*case, args, tmp) for case in CALIBRATE]
            held = [best_observation(*case, args, tmp) for case in HELD_OUT]
    if args.save:
        with open(args.save, "w", encoding="utf-8") as handle:
            json.dump({o.label: o.measured_seconds * 1e3 for o in fit_on + held}, handle, indent=1)
    fitted = calibrate.fit(load_cluster(args.cluster), fit_on, keys=FIT_KEYS)
    rows = calibrate.error_table(fitted, fit_on + held)
    values = ", ".join(f"{k} {getattr(fitted.efficiency, k):.3g}" for k in FIT_KEYS)
    print(f"fitted on {len(fit_on)} layouts: {values}")
    rounds = "recorded" if args.load else f"best of {args.rounds}"
    print(f"| layout | ranks | role | measured ms/iter ({rounds}) | predicted | error |")
    print("|---|---|---|---|---|---|")
    for (label, measured, predicted, error), obs in zip(rows, fit_on + held):
        role = "fitted" if obs in fit_on else "held out"
        print(f"| {label} | {obs.world_size} | {role} | {measured * 1e3:.0f} | {predicted * 1e3:.0f} | {error:+.1%} |")
    return 0


def recorded(path: str) -> tuple[list, list]:
    """Observations from a --save file (configs rebuilt as the runs had them; the sample corpus's 257)."""
    with open(path, encoding="utf-8") as handle:
        measured = json.load(handle)

    def observation(label: str, ranks: int, overrides: list[str]):
        config = load_config(DEFAULT_CONFIG, [*MODEL, *overrides, "model.vocab_size=257"])
        return calibrate.Observation(label, config, ranks, measured[label] / 1e3)

    return [observation(*c) for c in CALIBRATE], [observation(*c) for c in HELD_OUT]


if __name__ == "__main__":
    sys.exit(main())
