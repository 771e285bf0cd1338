"""The fit of the A100 efficiency constants to Table 1, and how well it predicts what it never saw.

The fit runs every Table 1 row at the paper's schedule (published.with_paper_schedule: interleaved with
scatter/gather, the chunks set by `published.paper_vp`, the gradient all-reduce not overlapped). Free
parameters (FIT_KEYS): the GEMM curve's `gemm_max` and `gemm_half_flops`, each only where the fitted rows
can see it (`identifiable_keys`), else left at its prior (START). The others cannot be told apart
by Table 1 and are fixed priors (FIXED): every row with a pipeline has t = 8 inside a node (nvlink), the
memory-bound share only changes with h as the GEMM curve does (hbm), and fitted freely `network` ran to
its bound on rows 1-5 (1.0) and to 0.40 on rows 6-10, which then missed rows 3-4 by 14%: the halves cannot
tell it from the GEMM curve. Priors: `hbm` 0.85 (streaming kernels on A100 reach about 85% of the HBM
peak), `nvlink` 0.75 (NCCL all-reduce bus bandwidth on DGX A100, ~230 of 300 GB/s), `network` 0.92 (NCCL
over one 200 Gb/s HDR port, ~23 of 25 GB/s), 10 us per message.

The report: in-sample errors of the fit on all ten rows, then the two halves (fit rows 1-5 and predict
6-10, fit 6-10 and predict 1-5), and Table 2 (never fitted) at the all-rows constants.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from planner import calibrate, published
from planner.cluster import ClusterSpec

FIT_KEYS = ("gemm_max", "gemm_half_flops")
START = {"gemm_max": 0.8, "gemm_half_flops": 2.0e9}  # priors: where every fit starts, kept if not identifiable
SENSITIVITY = 0.01  # a key is fitted only if scaling it by e^-0.5 moves some fitted row by 1% or more
FIXED = {"hbm": 0.85, "nvlink": 0.75, "network": 0.92, "latency_us": 10.0}


@dataclass
class FitResult:
    """One fit: its constants, and the relative TFLOP/s error of every row it was checked on."""

    name: str
    fitted_on: list[str]
    constants: dict[str, float]
    errors: dict[str, float]  # label -> predicted / published TFLOP/s - 1


def tflops_errors(cluster: ClusterSpec, observations: list) -> dict[str, float]:
    """Predicted / published TFLOP/s - 1 per observation (time errors inverted)."""
    return {
        label: measured / predicted - 1.0
        for label, measured, predicted, _ in calibrate.error_table(cluster, observations)
    }


def identifiable_keys(cluster: ClusterSpec, observations: list) -> tuple[str, ...]:
    """The FIT_KEYS these observations can tell (the others stay at the cluster's value): rows 6-10 alone
    cannot see gemm_half_flops (their GEMMs are 50-500x larger), and fitted anyway it drifts."""
    base = calibrate.log_errors(cluster, observations)
    keys = []
    for key in FIT_KEYS:
        probe = cluster.with_efficiency(**{key: getattr(cluster.efficiency, key) * math.exp(-0.5)})
        moved = max(abs(a - b) for a, b in zip(calibrate.log_errors(probe, observations), base))
        if moved >= SENSITIVITY or key == FIT_KEYS[0]:
            keys.append(key)
    return tuple(keys)


def fit_rows(
    cluster: ClusterSpec, rows: list, name: str, progress: Callable[[str], None] | None = None
) -> tuple[ClusterSpec, FitResult]:
    """Fit FIT_KEYS to `rows` (published rows) from the FIXED priors; errors on Table 1 and Table 2."""
    start = cluster.with_efficiency(**FIXED, **START)
    observations = published.observations(rows)
    keys = identifiable_keys(start, observations)
    fitted = calibrate.fit(start, observations, keys=keys, iterations=6, progress=progress)
    checked = published.observations(published.TABLE_1)
    constants = {k: float(getattr(fitted.efficiency, k)) for k in keys}
    return fitted, FitResult(name, [r.label for r in rows], constants, tflops_errors(fitted, checked))


def leave_half_out(
    cluster: ClusterSpec, progress: Callable[[str], None] | None = None
) -> tuple[ClusterSpec, list[FitResult]]:
    """The all-rows fit (also checked on Table 2) and the results of all rows, rows 1-5 and rows 6-10."""
    table = published.TABLE_1
    results = []
    fitted_all, everything = fit_rows(cluster, table, "all ten rows", progress)
    everything.errors.update(tflops_errors(fitted_all, published.observations(published.TABLE_2_PTDP)))
    results.append(everything)
    for name, rows in (("rows 1-5", table[:5]), ("rows 6-10", table[5:])):
        results.append(fit_rows(cluster, rows, name, progress)[1])
    return fitted_all, results


def report_lines(results: list[FitResult]) -> list[str]:
    """The fit report as markdown: constants, then one column of errors per fit (held-out rows marked *)."""
    lines = [f"free parameters: {', '.join(FIT_KEYS)}; fixed: " + ", ".join(f"{k} {v}" for k, v in FIXED.items())]
    for r in results:
        values = ", ".join(f"{k} {v:.4g}" for k, v in r.constants.items())
        lines.append(f"- fit on {r.name} ({len(r.fitted_on)} points): {values}")
    labels = list(results[0].errors)
    lines += ["", "| row | " + " | ".join(r.name for r in results) + " |", "|---" * (len(results) + 1) + "|"]
    for label in labels:
        cells = []
        for r in results:
            if label not in r.errors:
                cells.append("")
                continue
            mark = "" if label in r.fitted_on else "*"
            cells.append(f"{r.errors[label]:+.1%}{mark}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    held = [abs(e) for r in results[1:] for k, e in r.errors.items() if k not in r.fitted_on]
    lines.append("")
    lines.append(f"(* = not fitted by that column; worst leave-half-out error {max(held):.1%})")
    return lines
