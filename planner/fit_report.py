"""The fit of the A100 efficiency constants to Table 1, and how well it predicts what it never saw.

The fit runs every Table 1 row as the paper ran it (published.py: the sc21 scripts' micro-batches, chunks
and DDP kinds). Free parameters (FIT_KEYS): the GEMM curve's `gemm_max` and the memory-bound kernels' `hbm`,
each only where the fitted rows can see it (`identifiable_keys`). `hbm` is fitted with a prior (a MAP fit,
calibrate.fit's prior_sigma): 0.75 of the HBM peak (2021's kernels: apex layer norm, the fused softmax, an
unfused attention dropout) within about 20%, against about 3% of error per published row, so the rows that
see it (the small models, whose materialised [s, s] attention is a third of their time) move it and the
others keep it near the prior. The rest cannot be told apart by Table 1 and are fixed priors (FIXED):
every row with tensor parallelism has t <= 8 inside a node (nvlink 0.75: NCCL all-reduce bus bandwidth on
DGX A100, ~230 of 300 GB/s), the data-parallel reduction is at most a few % of any row (network 0.92: NCCL
over one 200 Gb/s HDR port, ~23 of 25 GB/s), the latencies are NCCL's own tuning table's (8.4 us per call,
per ring step 10 us across nodes and 3.4 over NVLink), and `gemm_half_flops` 2e9 (a fixed ~8 us per GEMM) is invisible to
GEMMs of 1e11 FLOPs and more.

The report: in-sample errors of the fit on all ten rows, then the two halves (fit rows 1-5 and predict
6-10, fit 6-10 and predict 1-5), and Table 2 (never fitted) at the all-rows constants.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from planner import calibrate, published
from planner.cluster import ClusterSpec, Efficiency

FIT_KEYS = ("gemm_max", "hbm")
START = {"gemm_max": 0.8, "hbm": 0.75}  # priors: where every fit starts, kept if not identifiable
SENSITIVITY = 0.01  # a key is fitted only if scaling it by e^-0.5 moves some fitted row by 1% or more
ROW_ERROR = 0.03  # the log error expected of one published row (rounded TF/GPU, run-to-run spread, model)
PRIOR_SIGMA = {"hbm": 0.2 / ROW_ERROR}  # hbm's prior width (20%) in units of one row's error
_NCCL_LATENCIES = ("latency_us", "nvlink_latency_us", "collective_base_us")  # Efficiency's defaults: NCCL's table
FIXED = {
    "nvlink": 0.75,
    "network": 0.92,
    "gemm_half_flops": 2.0e9,
    **{k: getattr(Efficiency(), k) for k in _NCCL_LATENCIES},
}


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
    fitted = calibrate.fit(start, observations, keys=keys, iterations=6, progress=progress, prior_sigma=PRIOR_SIGMA)
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
    lines = [f"free parameters: {', '.join(FIT_KEYS)}; fixed: " + ", ".join(f"{k} {v:g}" for k, v in FIXED.items())]
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
