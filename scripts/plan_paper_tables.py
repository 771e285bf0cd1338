"""The planner against the paper's published throughputs (Narayanan et al., SC21, DGX A100 80GB).

    python scripts/plan_paper_tables.py [--cluster configs/clusters/dgx_a100_80gb.yaml] [--fit]

Prints Table 1 (the ten configs of configs/paper/) and the PTD-P rows of Table 2, predicted against
published, as markdown. --fit first fits the cluster's efficiency constants to Table 1 (Table 2 is then held
out: the fit never sees it) and prints the fitted `efficiency:` section to put into the cluster file. The
fit moves gemm_max and hbm only: Table 1 runs every model at micro-batch 1, so the size of the GEMM at half
efficiency (gemm_half_flops) comes from the micro-batch figures (§5.5, Figure 16: micro-batch 2 is the best
for a 91B model at (t, p) = (8, 8)); see docs/performance.md.
"""

from __future__ import annotations

import argparse
import sys
import time

from planner import calibrate, published
from planner.cluster import efficiency_yaml, load_cluster
from planner.predict import predict


def table(cluster, rows, title: str) -> list[str]:
    lines = [
        f"**{title}**",
        "",
        "| model | GPUs | tp | pp | dp | batch | published TF/GPU (% of peak) | predicted TF/GPU | error | "
        "predicted s/iter | bubble | tp comm | dp comm | memory GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        p = predict(row.config(), cluster, row.world_size)
        lay, frac = p.layout, {k: v / p.iteration_seconds for k, v in p.breakdown.items()}
        percent = f" ({row.percent_of_peak:.0f}%)" if row.percent_of_peak else ""
        lines.append(
            f"| {row.label} | {row.world_size} | {lay.tp_size} | {lay.pp_size} | {lay.dp_size} | "
            f"{row.config().train.global_batch_size} | {row.tflops_per_gpu:.0f}{percent} | "
            f"{p.tflops_per_gpu:.1f} | {p.tflops_per_gpu / row.tflops_per_gpu - 1:+.1%} | "
            f"{p.iteration_seconds:.2f} | {frac['bubble']:.1%} | {frac['tp_comm']:.1%} | "
            f"{frac['dp_comm']:.1%} | {p.memory_gib:.1f} |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="configs/clusters/dgx_a100_80gb.yaml")
    parser.add_argument("--fit", action="store_true", help="fit the efficiency constants to Table 1 first")
    args = parser.parse_args()
    cluster = load_cluster(args.cluster)
    if args.fit:
        start = time.time()
        cluster = calibrate.fit(
            cluster,
            published.observations(published.TABLE_1),
            keys=("gemm_max", "hbm"),
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
        print(f"fitted in {time.time() - start:.0f} s:\n{efficiency_yaml(cluster.efficiency)}")
    print("\n".join(table(cluster, published.TABLE_1, "Table 1 (weak scaling)")))
    print()
    print("\n".join(table(cluster, published.TABLE_2_PTDP, "Table 2, PTD-P rows (fixed batch, more GPUs)")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
