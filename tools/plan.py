"""Predict throughput and memory of a PTD-P layout on a cluster, pick the best layout, calibrate.

    python tools/plan.py --config configs/paper/gpt_1t.yaml --cluster configs/clusters/dgx_a100_80gb.yaml \
        --gpus 3072 [section.key=value ...] [--json] [--search [--top 10]] [--plot DIR]
    python tools/plan.py --cluster configs/clusters/dgx_a100_80gb.yaml --calibrate runs/X [runs/Y ...] \
        [--output fitted_cluster.yaml]

The layout, micro-batch, global batch, precision and recomputation come from the config (the trainer's
section.key=value overrides apply; parallel.fsdp=true: ZeRO-3, sharded data parallelism). --compare predicts the
config's layout against ZeRO-3 without model parallelism (tp 1, pp 1) and FSDP with tp over one node, at the same
model, batch and GPUs, and says which wins and why. --software paper predicts as the paper's software ran it in
2021 (Megatron-LM's local DDP; DeepSpeed's ZeRO-3 with parallel.fsdp=true) instead of this trainer. What the
model counts and ignores: docs/planner.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import yaml

from config.cli import numbers_as_values, one_config_file
from config.schema import ConfigError, load_config
from config.yaml_reader import read_yaml_file
from model.shape import total_params
from parallel.layout import LayoutError
from planner import calibrate
from planner.cluster import ClusterError, ClusterSpec, efficiency_yaml, load_cluster
from planner.plots import draw_all
from planner.predict import Prediction, fusion_speedup, predict
from planner.published import paper_software
from planner.search import (
    IN_DOMAIN_ERROR,
    OUT_OF_DOMAIN_ERROR,
    conservative_seconds,
    outside_domain,
    search,
    why_best_wins,
    with_layout,
)
from planner.software import TRAINER

if TYPE_CHECKING:
    from config.schema import Config
    from planner.software import Software

SOFTWARE = ("trainer", "paper")
MAX_GPUS = 2**20  # ten times the largest clusters; --search's divisor loop is linear in it
NUMBER_OPTIONS = ("--gpus", "--top", "--tokens")  # `--tokens -1e9` is then a value, refused in one line
DEFAULT_TOP = 10


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", help="model/run config YAML (configs/...), given once")
    parser.add_argument("--cluster", required=True, help="cluster spec YAML (configs/clusters/...)")
    parser.add_argument("--gpus", type=int, help="number of GPUs (the world size)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--search", action="store_true", help="rank every valid layout that fits in memory")
    parser.add_argument("--top", type=int, help=f"layouts to print with --search (default {DEFAULT_TOP})")
    parser.add_argument("--plot", metavar="DIR", help="write the tp/pp, micro-batch and interleaving sweeps")
    parser.add_argument("--calibrate", nargs="+", metavar="RUN", help="fit the efficiency constants to runs")
    parser.add_argument("--output", help="with --calibrate: write the cluster spec with the fitted constants")
    parser.add_argument("--tokens", type=float, help="print the end-to-end training time for this many tokens")
    parser.add_argument(
        "--compare", action="store_true", help="the config's layout against ZeRO-3 (tp 1, pp 1) and FSDP + tp"
    )
    parser.add_argument(
        "--software",
        choices=SOFTWARE,
        default="trainer",
        help="trainer: as this trainer runs it (default); paper: as Megatron-LM / DeepSpeed ran the paper's runs",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    return parser.parse_args(numbers_as_values(sys.argv[1:] if argv is None else argv, NUMBER_OPTIONS))


def no_layout_message(config: Config, gpus: int) -> str:
    """Why --search found nothing to rank: no layout of this model and batch divides the GPU count."""
    model, train = config.model, config.train
    return (
        f"no layout divides --gpus {gpus}: tp must divide model.num_attention_heads={model.num_attention_heads}, "
        f"pp model.num_layers={model.num_layers}, and dp train.global_batch_size={train.global_batch_size} "
        f"(with the micro-batch); give a GPU count these divide"
    )


def format_prediction(p: Prediction) -> list[str]:
    lay = p.layout
    lines = [
        f"layout: {lay.describe()}, micro-batch {p.micro_batch_size}, recompute {p.recompute}",
        f"predicted: {p.tflops_per_gpu:.1f} TFLOP/s per GPU, {p.iteration_seconds:.3f} s per iteration",
        "time per iteration (critical pipeline rank):",
    ]
    for key, seconds in p.breakdown.items():
        extra = f" (recomputation {p.recompute_seconds:.3f} s)" if key == "compute" and p.recompute_seconds else ""
        lines.append(f"  {key:<10} {seconds:9.3f} s  {seconds / p.iteration_seconds:6.1%}{extra}")
    verdict = "fits" if p.fits else "DOES NOT FIT"
    lines.append(
        f"memory per GPU (pipeline rank {p.memory.pp_rank}, {p.memory.params:,} parameters): "
        f"{p.memory_gib:.1f} GiB of {p.memory_capacity_gib:.0f} GiB, {verdict}"
    )
    for key, gib in p.memory.as_gib().items():
        if key != "total":
            lines.append(f"  {key:<12} {gib:8.2f} GiB")
    return lines


def format_ranking(ranked: list[Prediction], top: int) -> list[str]:
    lines = [
        f"{'#':>3}  {'layout':<48} {'TF/GPU':>7} {'s/iter':>8} {'conserv.':>8} {'GiB':>6} {'bubble':>7} "
        f"{'tp':>6} {'dp':>6}  outside the calibrated domain"
    ]
    for i, p in enumerate(ranked[:top], 1):
        frac = {k: v / p.iteration_seconds for k, v in p.breakdown.items()}
        outside = ", ".join(outside_domain(p)) or "-"
        lines.append(
            f"{i:>3}  {p.describe_layout():<48} {p.tflops_per_gpu:7.1f} {p.iteration_seconds:8.3f} "
            f"{conservative_seconds(p):8.3f} {p.memory_gib:6.1f} {frac['bubble']:7.1%} {frac['tp_comm']:6.1%} "
            f"{frac['dp_comm']:6.1%}  {outside}"
        )
    return lines


def training_time_lines(p: Prediction, config: Config, tokens: float) -> list[str]:
    """End-to-end training time for `tokens` tokens: the planner's (iterations x predicted time) and the
    paper's equation (4), 8 T P / (n X), with X the predicted TFLOP/s per GPU."""
    batch_tokens = config.train.global_batch_size * config.model.seq_length
    iterations = tokens / batch_tokens
    planner_days = iterations * p.iteration_seconds / 86400
    params = total_params(config.model)
    equation_days = 8 * tokens * params / (p.layout.world_size * p.tflops_per_gpu * 1e12) / 86400
    return [
        f"training on {tokens:.3g} tokens: {iterations:,.0f} iterations of {batch_tokens:,} tokens",
        f"  planner: {planner_days:.1f} days ({p.iteration_seconds:.3f} s per iteration)",
        f"  equation (4), 8 T P / (n X) with P {params / 1e9:.1f}B, n {p.layout.world_size}, "
        f"X {p.tflops_per_gpu:.1f} TF: {equation_days:.1f} days",
    ]


def compared_schemes(config: Config, gpus_per_node: int) -> list[tuple[str, Config]]:
    """(name, config) of the three schemes --compare predicts: the config's own layout (PTD-P, or whatever it
    says), ZeRO-3 without model parallelism, and FSDP with tp over one node (sequence parallel), all at the
    config's model, batch, micro-batch and recomputation."""
    model = config.model
    node_tp = max(t for t in range(1, gpus_per_node + 1) if not model.num_attention_heads % t and not gpus_per_node % t)
    zero3 = with_layout(config, 1, 1, 1, config.train.micro_batch_size, config.train.recompute, fsdp=True)
    fsdp_tp = with_layout(config, node_tp, 1, 1, config.train.micro_batch_size, config.train.recompute, fsdp=True)
    fsdp_tp = dataclasses.replace(fsdp_tp, parallel=dataclasses.replace(fsdp_tp.parallel, sequence_parallel=True))
    return [("config", config), ("ZeRO-3 (tp 1, pp 1)", zero3), (f"FSDP + tp {node_tp} (sp)", fsdp_tp)]


def run_compare(
    config: Config, cluster: ClusterSpec, args: argparse.Namespace, software_of: Callable[[Config], Software]
) -> int:
    """Predict the schemes of `compared_schemes` and say which wins and why (largest time terms)."""
    results: list[tuple[str, Prediction | str]] = []
    for name, candidate in compared_schemes(config, cluster.gpus_per_node):
        try:
            results.append((name, predict(candidate, cluster, args.gpus, software_of(candidate))))
        except LayoutError as err:
            results.append((name, f"invalid: {err}"))
    valid = [(n, p) for n, p in results if isinstance(p, Prediction) and p.fits]
    verdict = compare_verdict(valid)
    if args.json:
        print(
            json.dumps(
                {
                    "schemes": {n: (p.to_dict() if isinstance(p, Prediction) else p) for n, p in results},
                    "verdict": verdict,
                }
            )
        )
        return 0
    for name, p in results:
        if isinstance(p, str):
            print(f"{name}: {p}")
            continue
        fits = "fits" if p.fits else "DOES NOT FIT"
        print(
            f"{name}: {p.describe_layout()}: {p.tflops_per_gpu:.1f} TFLOP/s per GPU, {p.iteration_seconds:.2f} s per "
            f"iteration, {p.memory_gib:.1f} GiB ({fits}); "
            + ", ".join(f"{k} {v:.2f} s" for k, v in p.breakdown.items() if v > 0)
        )
    print(f"why: {verdict}")
    return 0


def compare_verdict(valid: list[tuple[str, Prediction]]) -> str:
    """Which scheme is fastest, by how much, and the time terms that make the difference."""
    if not valid:
        return "none of the schemes fits in memory"
    ranked = sorted(valid, key=lambda item: item[1].iteration_seconds)
    best_name, best = ranked[0]
    lines = []
    for name, other in ranked[1:]:
        deltas = sorted(((other.breakdown[k] - best.breakdown[k], k) for k in best.breakdown), reverse=True)
        terms = ", ".join(f"{k.replace('_', ' ')} +{d:.2f} s" for d, k in deltas[:2] if d > 0)
        lines.append(
            f"{other.iteration_seconds / best.iteration_seconds:.2f}x faster than {name} ({terms or 'no term'})"
        )
    return f"{best_name} wins: " + ("; ".join(lines) if lines else "the only scheme that fits")


def run_calibration(args: argparse.Namespace, cluster: ClusterSpec) -> int:
    observations = [calibrate.load_run(run) for run in args.calibrate]
    before = calibrate.error_table(cluster, observations)
    fitted = calibrate.fit(cluster, observations)
    after = calibrate.error_table(fitted, observations)
    if args.json:
        print(
            json.dumps(
                {
                    "efficiency": dataclasses.asdict(fitted.efficiency),
                    "runs": [
                        {
                            "run": b[0],
                            "measured_seconds": b[1],
                            "predicted_before": b[2],
                            "error_before": b[3],
                            "predicted_after": a[2],
                            "error_after": a[3],
                        }
                        for b, a in zip(before, after)
                    ],
                }
            )
        )
    else:
        print(f"{'run':<40} {'measured s':>11} {'before':>10} {'error':>8} {'after':>10} {'error':>8}")
        for b, a in zip(before, after):
            print(f"{b[0]:<40} {b[1]:11.4f} {b[2]:10.4f} {b[3]:+8.1%} {a[2]:10.4f} {a[3]:+8.1%}")
        worst = max(abs(a[3]) for a in after)
        print(f"model error after the fit: at most {worst:.1%} over {len(after)} run(s)")
        print(efficiency_yaml(fitted.efficiency).rstrip())
    if args.output:
        raw = read_yaml_file(args.cluster, "cluster", ClusterError)
        raw["efficiency"] = dataclasses.asdict(fitted.efficiency)
        raw["calibration"] = f"fitted by tools/plan.py --calibrate to {', '.join(args.calibrate)}"
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output + ".tmp", "w", encoding="utf-8") as handle:
            yaml.safe_dump(raw, handle, sort_keys=False)
        os.replace(args.output + ".tmp", args.output)
    return 0


def refuse_ignored_options(args: argparse.Namespace) -> None:
    """Refuse an option the chosen mode would not read: --compare prints three schemes (no ranking, no training
    time), --search a ranking (no training time), and --top only trims --search's ranking."""
    if args.compare:
        unused = {"--search": args.search, "--top": args.top is not None, "--tokens": args.tokens is not None}
        given = [name for name, is_given in unused.items() if is_given]
        if given:
            raise ConfigError(f"--compare does not use {', '.join(given)}: run --compare and {given[0]} separately")
    if args.search and args.tokens is not None:
        raise ConfigError("--search does not use --tokens: give --tokens without --search, on the layout you chose")
    if args.top is not None and not args.search:
        raise ConfigError(f"--top {args.top} only trims --search's ranking: add --search or drop --top")


def run_plan(args: argparse.Namespace, cluster: ClusterSpec) -> int:
    if not args.config or args.gpus is None:
        raise ConfigError("--config and --gpus are needed (or --calibrate RUN)")
    refuse_ignored_options(args)
    if not 1 <= args.gpus <= MAX_GPUS:  # the layout search enumerates divisors one by one
        raise ConfigError(f"--gpus {args.gpus} must be in [1, {MAX_GPUS:,}]")
    if args.tokens is not None and not 0 < args.tokens < math.inf:
        raise ConfigError(f"--tokens {args.tokens:g} must be a positive number of training tokens")
    top = DEFAULT_TOP if args.top is None else args.top
    if top < 1:
        raise ConfigError(f"--top {args.top} must be >= 1")
    config = load_config(one_config_file(args.config, None), args.overrides)
    if config.model.vocab_size is None:
        raise ConfigError("model.vocab_size must be set for the planner (no tokenizer is loaded)")
    if args.plot:
        for path in draw_all(config, cluster, args.gpus, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    software_of = paper_software if args.software == "paper" else (lambda _: TRAINER)
    if args.compare:
        return run_compare(config, cluster, args, software_of)
    if args.search:
        result = search(config, cluster, args.gpus, software_of=software_of)
        if not result.considered:
            raise ConfigError(no_layout_message(config, args.gpus))
        reason = why_best_wins(result)
        if args.json:
            print(
                json.dumps(
                    {
                        "best": result.best.to_dict() if result.ranked else None,
                        "reason": reason,
                        "ranked": [p.to_dict() for p in result.ranked[:top]],
                        "considered": result.considered,
                        "fitting": result.fitting,
                    }
                )
            )
            return 0
        print(
            f"{result.considered} valid layouts, {result.fitting} fit in {cluster.memory_gib:.0f} GiB; "
            f"the best by first estimate and the config's own simulated in full, ranked by a conservative time per "
            f"iteration (conserv.: +{IN_DOMAIN_ERROR:.0%}, +{OUT_OF_DOMAIN_ERROR:.0%} more per dimension outside "
            f"the calibrated domain; TF/GPU as the trainer counts it: full recompute's extra forward counts as work):"
        )
        print("\n".join(format_ranking(result.ranked, top)))
        print(f"why: {reason}")
        return 0
    software = software_of(config)
    prediction = predict(config, cluster, args.gpus, software)
    speedup = fusion_speedup(config, cluster, args.gpus, prediction, software)
    if args.json:
        extra = {"training_time": training_time_lines(prediction, config, args.tokens)} if args.tokens else {}
        print(
            json.dumps(
                {
                    **prediction.to_dict(),
                    "fusion_speedup": speedup,
                    "cluster": cluster.name,
                    "software": args.software,
                    **extra,
                }
            )
        )
        return 0
    print(f"cluster: {cluster.name} ({args.gpus} GPUs, {cluster.gpus_per_node} per node)")
    print("\n".join(format_prediction(prediction)))
    print("\n".join(sections_5_8_to_5_10(prediction, speedup)))
    outside = outside_domain(prediction)
    if outside:
        print(f"outside the calibrated domain ({', '.join(outside)}): an extrapolation")
    if args.tokens:
        print("\n".join(training_time_lines(prediction, config, args.tokens)))
    return 0


def sections_5_8_to_5_10(p: Prediction, speedup: float) -> list[str]:
    """Kernel fusion's gain, inter-node traffic and the checkpoint (the paper's §5.8-5.10; docs/planner.md)."""
    t = p.traffic
    lines = [
        f"fused kernels: {speedup:.3f}x the throughput without ({p.tflops_per_gpu / speedup:.1f} TFLOP/s per GPU "
        f"unfused)",
        f"inter-node traffic per iteration: pipeline {t.p2p_bytes / 1e12:.2f} TB ({t.p2p_bandwidth_gbps:,.0f} GB/s "
        f"over the iteration), data-parallel reduction {t.dp_bytes / 1e12:.2f} TB ({t.dp_allreduce_bandwidth_gbps:,.0f}"
        f" GB/s over the iteration, {t.dp_allreduce_busy_bandwidth_gbps:,.0f} GB/s over its {t.dp_seconds:.3f} s)",
    ]
    checkpoint = f"checkpoint: {p.checkpoint_bytes / 1e12:.2f} TB"
    if p.checkpoint_save_seconds is not None and p.checkpoint_load_seconds is not None:
        checkpoint += f", save {p.checkpoint_save_seconds:.1f} s, load {p.checkpoint_load_seconds:.1f} s"
    else:
        checkpoint += " (the cluster file has no storage section for save and load times)"
    return [*lines, checkpoint]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cluster = load_cluster(args.cluster)
        if args.calibrate:
            return run_calibration(args, cluster)
        return run_plan(args, cluster)
    except (ConfigError, ClusterError, LayoutError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
