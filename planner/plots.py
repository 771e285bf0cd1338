"""The paper's sweeps from the cost model, as PNGs (matplotlib): Figures 12, 13/15 and 16 in shape.

- tp_vs_pp.png: fixed model-parallel size tp*pp, every split of it, at several batch sizes (Figure 13).
- microbatch.png: throughput against the micro-batch size at two batch sizes (Figure 16).
- interleaving.png: interleaved against plain 1F1B over batch sizes (Figure 12).
Points whose layout does not fit in memory are drawn hollow.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from parallel.layout import LayoutError
from planner.cluster import ClusterSpec
from planner.predict import predict
from planner.pyplot import pyplot
from planner.search import with_layout

if TYPE_CHECKING:
    from config.schema import Config


def _batch(config: Config, global_batch: int) -> Config:
    return dataclasses.replace(config, train=dataclasses.replace(config.train, global_batch_size=global_batch))


def _point(config: Config, cluster: ClusterSpec, world: int) -> tuple[float, bool] | None:
    try:
        p = predict(config, cluster, world)
    except LayoutError:
        return None
    return p.tflops_per_gpu, p.fits


def batch_sizes(config: Config, world: int) -> list[int]:
    """Batch sizes around the config's: 1/4, 1/2, 1 and 2 times it."""
    base = config.train.global_batch_size
    return sorted({max(1, int(base * f)) for f in (0.25, 0.5, 1.0, 2.0)})


def _plot_series(ax, xs, points, label) -> None:
    kept = [(x, p) for x, p in zip(xs, points) if p is not None]
    if not kept:
        return
    (line,) = ax.plot([x for x, _ in kept], [p[0] for _, p in kept], "-", label=label)
    for x, (y, fits) in kept:
        ax.plot([x], [y], "o", color=line.get_color(), markerfacecolor=line.get_color() if fits else "none")


def sweep_tp_pp(config: Config, cluster: ClusterSpec, world: int) -> dict[int, list]:
    """{batch: [(tp, pp, point)]} over every split of the config's tp*pp."""
    model_parallel = config.parallel.tp_size * config.parallel.pp_size
    splits = [(t, model_parallel // t) for t in range(1, model_parallel + 1) if model_parallel % t == 0]
    mb, recompute = config.train.micro_batch_size, config.train.recompute
    return {
        batch: [
            (t, p, _point(_batch(with_layout(config, t, p, 1, mb, recompute), batch), cluster, world))
            for t, p in splits
        ]
        for batch in batch_sizes(config, world)
    }


def sweep_microbatch(config: Config, cluster: ClusterSpec, world: int) -> dict[int, list]:
    """{batch: [(micro-batch, point)]} for the config's layout."""
    par, recompute = config.parallel, config.train.recompute
    base = config.train.global_batch_size
    return {
        batch: [
            (
                mb,
                _point(
                    _batch(with_layout(config, par.tp_size, par.pp_size, par.vp_size, mb, recompute), batch),
                    cluster,
                    world,
                ),
            )
            for mb in (1, 2, 4, 8, 16)
        ]
        for batch in sorted({max(1, base // 4), base})
    }


def sweep_interleaving(config: Config, cluster: ClusterSpec, world: int, vp: int) -> dict[int, list]:
    """{vp: [(batch, point)]} for plain 1F1B (vp 1) and `vp` chunks."""
    par, train = config.parallel, config.train
    per_step = world // (par.tp_size * par.pp_size) * train.micro_batch_size * par.pp_size
    batches = [per_step * k for k in (1, 2, 3, 4, 6, 8, 12, 16)]
    return {
        v: [
            (
                b,
                _point(
                    _batch(
                        with_layout(config, par.tp_size, par.pp_size, v, train.micro_batch_size, train.recompute), b
                    ),
                    cluster,
                    world,
                ),
            )
            for b in batches
        ]
        for v in (1, vp)
    }


def draw_all(config: Config, cluster: ClusterSpec, world: int, out_dir: str) -> list[str]:
    """Write the three PNGs into out_dir; returns their paths."""
    plt = pyplot()
    os.makedirs(out_dir, exist_ok=True)
    name = f"{config.model.num_layers} layers, h {config.model.hidden_size}, {world} GPUs, {cluster.name}"
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    sweep = sweep_tp_pp(config, cluster, world)
    for batch, series in sweep.items():
        labels = [f"({t},{p})" for t, p, _ in series]
        _plot_series(ax, list(range(len(series))), [pt for _, _, pt in series], f"batch {batch}")
        ax.set_xticks(range(len(series)), labels)
    ax.set_xlabel("(tensor-parallel size, pipeline-parallel size)")
    paths.append(_finish(fig, ax, f"tp vs pp: {name}", os.path.join(out_dir, "tp_vs_pp.png")))

    fig, ax = plt.subplots(figsize=(6, 4))
    for batch, series in sweep_microbatch(config, cluster, world).items():
        _plot_series(ax, [mb for mb, _ in series], [pt for _, pt in series], f"batch {batch}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batch size")
    paths.append(_finish(fig, ax, f"micro-batch size: {name}", os.path.join(out_dir, "microbatch.png")))

    fig, ax = plt.subplots(figsize=(6, 4))
    layers_per_stage = config.model.num_layers // config.parallel.pp_size
    vp = next((v for v in (2, 3, 4) if layers_per_stage % v == 0), 1)
    for v, series in sweep_interleaving(config, cluster, world, vp).items():
        label = "non-interleaved (1F1B)" if v == 1 else f"interleaved, {v} chunks"
        _plot_series(ax, [b for b, _ in series], [pt for _, pt in series], label)
    ax.set_xlabel("global batch size")
    paths.append(_finish(fig, ax, f"interleaving: {name}", os.path.join(out_dir, "interleaving.png")))
    return paths


def _finish(fig, ax, title: str, path: str) -> str:
    ax.set_ylabel("predicted TFLOP/s per GPU")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    pyplot().close(fig)
    os.replace(tmp, path)
    return path
