"""The planner against the paper's published throughputs (Narayanan et al., SC21, DGX A100 80GB).

    python scripts/plan_paper_tables.py [--cluster configs/clusters/dgx_a100_80gb.yaml] [--report] [--figures]
                                        [--trainer] [--figure-10 docs/plan/fig10.png]

Prints Table 1 (the ten configs of configs/paper/) and the PTD-P rows of Table 2 as the paper ran them
(planner/published.py: the sc21 scripts' micro-batches, chunks and DDP kinds), predicted against published, as
markdown. --report first runs the fit report (planner/fit_report.py: the fit on all ten rows, and the two
leave-half-out fits; several minutes of CPU) and prints the tables with the all-rows constants. --figures
prints every published effect of Figures 7 and 11-18 (planner/paper_figures.py) against the prediction.
--figure-10 prints Table 2 whole (its ZeRO-3 rows as DeepSpeed ran them: planner/figure_10.py) and draws
Figure 10. --trainer predicts the same configs as this trainer would run them (planner.software.TRAINER: fp32 bucketed
gradients, the executor's plan of pipeline messages with the config's overlap_p2p_comm) instead of as
Megatron-LM ran them in 2021.
"""

from __future__ import annotations

import argparse
import sys
import time

from planner import figure_10, fit_report, paper_figures, published
from planner.cluster import efficiency_yaml, load_cluster
from planner.predict import predict
from planner.software import TRAINER


def table(cluster, rows, title: str, trainer: bool = False) -> list[str]:
    lines = [
        f"**{title}**",
        "",
        "| model | GPUs | tp | pp | vp | dp | mb | batch | published TF/GPU (% of peak) | predicted TF/GPU | error | "
        "predicted s/iter | bubble | tp comm | dp comm | memory GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        p = predict(row.config(), cluster, row.world_size, TRAINER if trainer else row.run.software)
        lay, frac = p.layout, {k: v / p.iteration_seconds for k, v in p.breakdown.items()}
        percent = f" ({row.percent_of_peak:.0f}%)" if row.percent_of_peak else ""
        lines.append(
            f"| {row.label} | {row.world_size} | {lay.tp_size} | {lay.pp_size} | {lay.vp_size} | {lay.dp_size} | "
            f"{p.micro_batch_size} | "
            f"{row.config().train.global_batch_size} | {row.tflops_per_gpu:.0f}{percent} | "
            f"{p.tflops_per_gpu:.1f} | {p.tflops_per_gpu / row.tflops_per_gpu - 1:+.1%} | "
            f"{p.iteration_seconds:.2f} | {frac['bubble']:.1%} | {frac['tp_comm']:.1%} | "
            f"{frac['dp_comm']:.1%} | {p.memory_gib:.1f} |"
        )
    return lines


def figures(cluster) -> list[str]:
    """Every published effect of the figures against the planner (none of them fitted)."""
    lines = [
        "| figure | effect | published ratio | source | predicted ratio | agrees |",
        "|---|---|---|---|---|---|",
    ]
    for effect in paper_figures.EFFECTS:
        predicted = paper_figures.predicted_ratio(effect, cluster)
        published_ratio = f"{effect.ratio:.2f}" if effect.sized else ("> 1" if effect.ratio > 1 else "< 1")
        verdict = "yes" if paper_figures.agrees(effect, predicted) else "NO"
        band = f" +-{effect.tolerance:.0%}" if effect.sized else ""
        lines.append(
            f"| {effect.figure} | {effect.name} | {published_ratio}{band} | {effect.source}: {effect.note} | "
            f"{predicted:.2f} | {verdict} |"
        )
    fits = [b for b in paper_figures.FIGURE_17_BATCHES if paper_figures.fits_without_recompute(b, cluster)]
    lines.append("")
    lines.append(f"Figure 17 without recomputation fits at batch {', '.join(map(str, fits))} (published: up to 8)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="configs/clusters/dgx_a100_80gb.yaml")
    parser.add_argument("--report", action="store_true", help="run the fit report (and leave-half-out) first")
    parser.add_argument("--figures", action="store_true", help="the figures' effects against the planner")
    parser.add_argument("--trainer", action="store_true", help="as this trainer would run them (not as in 2021)")
    parser.add_argument("--figure-10", metavar="PNG", help="Table 2 / Figure 10 (PTD-P against ZeRO-3) and its plot")
    args = parser.parse_args()
    cluster = load_cluster(args.cluster)
    if args.report:
        start = time.time()
        cluster, results = fit_report.leave_half_out(cluster, lambda line: print(line, file=sys.stderr, flush=True))
        print("\n".join(fit_report.report_lines(results)))
        print(f"\nfitted in {time.time() - start:.0f} s:\n{efficiency_yaml(cluster.efficiency)}")
    if args.figures:
        print("\n".join(figures(cluster)))
        return 0
    if args.figure_10:
        points = figure_10.figure_10_points(cluster)
        print("\n".join(figure_10.table_lines(points)))
        print(f"wrote {figure_10.draw_figure_10(points, args.figure_10)}", file=sys.stderr)
        return 0
    how = ", as this trainer would run it" if args.trainer else ""
    print("\n".join(table(cluster, published.TABLE_1, f"Table 1 (weak scaling){how}", args.trainer)))
    print()
    title = f"Table 2, PTD-P rows (fixed batch, more GPUs){how}"
    print("\n".join(table(cluster, published.TABLE_2_PTDP, title, args.trainer)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
