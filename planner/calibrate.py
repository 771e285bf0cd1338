"""Fit the cluster's efficiency constants to measured iteration times, and report the model's error.

An observation is a config, a world size and a measured time per iteration: from a run folder of the trainer
(`config.yaml`, the resolved config it wrote, and `metrics.jsonl`, whose training records carry `ms_per_iter`
and `world_size`; records written before `world_size` was logged give it through `tflops_per_device`), or a
published figure (planner/published.py).
The fit minimises the squared log error over the observations (Levenberg-Marquardt in log space) over at most
as many constants as there are observations: gemm_max, hbm, gemm_half_flops; with one observation, one
common scale of gemm_max and hbm.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from config.schema import Config, ConfigError, load_config
from parallel.layout import layout_from_config
from parallel.run_shape import RunShape
from planner.cluster import ClusterSpec
from planner.predict import predict
from planner.software import TRAINER, Software

FITTED = ("gemm_max", "hbm", "gemm_half_flops")
BOUNDS = {
    "gemm_max": (0.01, 1.0),
    "hbm": (0.01, 1.0),
    "gemm_half_flops": (1e3, 1e13),
    "gemm_half_rows": (1.0, 1e6),
    "nvlink": (0.01, 1.0),
    "network": (0.01, 1.0),
    "latency_us": (0.1, 1e5),
    "nvlink_latency_us": (0.1, 1e5),
    "collective_base_us": (0.1, 1e5),
    "competing_processes": (0.01, 100.0),
}


@dataclass
class Observation:
    """A measured iteration time for a config on `world_size` GPUs."""

    label: str
    config: Config
    world_size: int
    measured_seconds: float
    software: Software = TRAINER  # how the measured run's software reduces gradients


def _training_records(path: str) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"{path}:{number} is not valid JSON") from None
            if (
                isinstance(record, dict)
                and "ms_per_iter" in record
                and ("world_size" in record or "tflops_per_device" in record)
            ):
                records.append(record)
    return records


def load_run(run_dir: str) -> Observation:
    """Read a trainer run folder: the median ms/iteration of its logged intervals (the first one, which
    holds the warm-up, is left out when there are others) and its world size."""
    config_path, metrics_path = os.path.join(run_dir, "config.yaml"), os.path.join(run_dir, "metrics.jsonl")
    for path in (config_path, metrics_path):
        if not os.path.isfile(path):
            raise ConfigError(f"{path} does not exist: --calibrate needs a run folder of pretrain_gpt.py")
    config = load_config(config_path)
    records = _training_records(metrics_path)
    if not records:
        raise ConfigError(f"{metrics_path} holds no training record with ms_per_iter")
    kept = records[1:] if len(records) > 1 else records
    seconds = statistics.median(r["ms_per_iter"] for r in kept) / 1000.0
    if "world_size" in kept[-1]:
        return Observation(run_dir, config, int(kept[-1]["world_size"]), seconds)
    return Observation(run_dir, config, _world_from_tflops(config, kept, seconds), seconds)


def _world_from_tflops(config: Config, records: list[dict], seconds: float) -> int:
    """The world size of a run logged before metrics.jsonl carried it: the iteration's FLOPs (RunShape, the
    trainer's figure, which does not depend on dp) over seconds x logged TFLOP/s per device."""
    par = config.parallel
    try:
        layout = layout_from_config(config, par.tp_size * par.cp_size * par.pp_size)
    except ValueError as err:
        raise ConfigError(f"cannot recover the world size of an old run from its config: {err}") from None
    flops = RunShape.of(config, layout).flops.with_recompute  # as the trainer's tflops_per_device
    tflops = statistics.median(r.get("tflops_per_device") or 0.0 for r in records)
    return max(1, round(flops / (seconds * tflops * 1e12))) if tflops > 0 else 1


def predicted_seconds(cluster: ClusterSpec, observations: list[Observation]) -> list[float]:
    return [predict(o.config, cluster, o.world_size, o.software).iteration_seconds for o in observations]


def log_errors(cluster: ClusterSpec, observations: list[Observation]) -> list[float]:
    return [math.log(p / o.measured_seconds) for p, o in zip(predicted_seconds(cluster, observations), observations)]


def _with_logs(cluster: ClusterSpec, keys: list[str], x: list[float], tied: bool) -> ClusterSpec:
    """The cluster with constants exp(x) (clamped to BOUNDS); `tied` scales gemm_max and hbm together."""
    eff = cluster.efficiency
    values: dict[str, Any]  # Efficiency's float fields by name (dataclasses.replace types each by its field)
    if tied:
        scale = math.exp(x[0])
        values = {"gemm_max": min(1.0, eff.gemm_max * scale), "hbm": min(1.0, eff.hbm * scale)}
    else:
        values = {k: min(BOUNDS[k][1], max(BOUNDS[k][0], math.exp(v))) for k, v in zip(keys, x)}
    return dataclasses.replace(cluster, efficiency=dataclasses.replace(eff, **values))


def fit(
    cluster: ClusterSpec,
    observations: list[Observation],
    iterations: int = 8,
    progress: Callable[[str], None] | None = None,
    keys: tuple[str, ...] = FITTED,
    prior_sigma: dict[str, float] | None = None,
) -> ClusterSpec:
    """The cluster with the efficiency constants that best explain the observations (Levenberg-Marquardt on
    the log errors, finite-difference Jacobian: a few predictions of every observation per iteration).
    At most len(observations) of `keys` are fitted; one observation fits one scale of gemm_max and hbm.
    `prior_sigma` gives keys a log-normal prior around their starting value, its width in units of one
    observation's log error (a MAP fit)."""
    if not observations:
        raise ValueError("calibration needs at least one observation")
    tied = len(observations) == 1
    fitted = ["scale"] if tied else list(keys)[: len(observations)]
    x = [0.0] if tied else [math.log(getattr(cluster.efficiency, k)) for k in fitted]

    # a log-normal prior around the starting value for the keys in prior_sigma (a MAP fit): a key the
    # observations hardly see stays near its prior instead of drifting
    centre = list(x)
    sigmas = [(prior_sigma or {}).get(k) for k in fitted] if not tied else [None]

    def residuals(point: list[float]) -> np.ndarray:
        errors = log_errors(_with_logs(cluster, fitted, point, tied), observations)
        errors += [(v - c) / sd for v, c, sd in zip(point, centre, sigmas) if sd]
        return np.asarray(errors, dtype=float)

    r = residuals(x)
    damping = 1e-2
    for step in range(iterations):
        jacobian = np.empty((len(r), len(x)))
        for j in range(len(x)):
            probe = list(x)
            probe[j] -= 0.05  # backward differences: constants often start at their upper bound (1.0)
            jacobian[:, j] = (r - residuals(probe)) / 0.05
        accepted = False
        while damping < 1e6 and not accepted:
            normal = jacobian.T @ jacobian + damping * np.eye(len(x))
            trial = [a + b for a, b in zip(x, np.linalg.solve(normal, -jacobian.T @ r))]
            r_trial = residuals(trial)
            if float(r_trial @ r_trial) < float(r @ r):
                x, r, accepted, damping = trial, r_trial, True, damping / 10
            else:
                damping *= 10
        if progress:
            progress(f"iteration {step + 1}: squared log error {float(r @ r):.6f}")
        if not accepted:
            break
    return _with_logs(cluster, fitted, x, tied)


def error_table(cluster: ClusterSpec, observations: list[Observation]) -> list[tuple[str, float, float, float]]:
    """(label, measured s, predicted s, relative error) per observation."""
    rows = []
    for o, p in zip(observations, predicted_seconds(cluster, observations)):
        rows.append((o.label, o.measured_seconds, p, p / o.measured_seconds - 1.0))
    return rows
