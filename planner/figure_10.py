"""Figure 10 of the paper (Table 2): PTD-P against ZeRO-3 without model parallelism at a fixed batch on more and
more GPUs, for the 174.6B and the 529.6B models; published against the planner.

Each point runs as the paper ran it (planner/published.py: Megatron-LM 2021's interleaved PTD-P, DeepSpeed 2021's
ZeRO-3, one constant of which is fitted on the 174.6B row at 768 GPUs), and the same layouts as this trainer would
run them (its 1F1B-interleaved PTD-P; its FSDP2 with prefetch and overlapped reductions: planner/sharded.py).
"""

from __future__ import annotations

import dataclasses
import os

from planner.cluster import ClusterSpec
from planner.predict import predict
from planner.published import TABLE_2_PTDP, TABLE_2_ZERO3, PublishedRow
from planner.pyplot import pyplot
from planner.software import TRAINER

MODELS = ("174.6B", "529.6B")


@dataclasses.dataclass(frozen=True)
class Figure10Point:
    model: str
    scheme: str  # "PTD-P" or "ZeRO-3"
    gpus: int
    micro_batch: int
    published: float
    as_paper_ran: float  # the planner, the paper's software
    this_trainer: float  # the planner, this trainer's software
    fits: bool  # as the paper ran it

    @property
    def error(self) -> float:
        return self.as_paper_ran / self.published - 1.0


def _point(row: PublishedRow, scheme: str, cluster: ClusterSpec) -> Figure10Point:
    config = row.config()
    paper = predict(config, cluster, row.world_size, row.run.software)
    trainer = predict(config, cluster, row.world_size, TRAINER)
    return Figure10Point(
        row.label.split()[0],
        scheme,
        row.world_size,
        config.train.micro_batch_size,
        row.tflops_per_gpu,
        paper.tflops_per_gpu,
        trainer.tflops_per_gpu,
        paper.fits,
    )


def figure_10_points(cluster: ClusterSpec) -> list[Figure10Point]:
    """Every point of Figure 10 (Table 2's twelve rows)."""
    return [_point(r, "PTD-P", cluster) for r in TABLE_2_PTDP] + [_point(r, "ZeRO-3", cluster) for r in TABLE_2_ZERO3]


def table_lines(points: list[Figure10Point]) -> list[str]:
    """The markdown table of the points, and the PTD-P / ZeRO-3 ratios at the doubled GPU counts."""
    lines = [
        "| model | scheme | GPUs | mb | published TF/GPU | planner, as the paper ran it | error | planner, this trainer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        fits = "" if p.fits else " (does not fit)"
        lines.append(
            f"| {p.model} | {p.scheme} | {p.gpus} | {p.micro_batch} | {p.published:.0f} | {p.as_paper_ran:.1f}{fits} | "
            f"{p.error:+.1%} | {p.this_trainer:.1f} |"
        )
    for model, gpus in (("174.6B", 768), ("529.6B", 1120)):
        ptdp = next(p for p in points if p.model == model and p.scheme == "PTD-P" and p.gpus == gpus)
        zero3 = next(p for p in points if p.model == model and p.scheme == "ZeRO-3" and p.gpus == gpus)
        lines.append(
            f"\n{model} on {gpus} GPUs, PTD-P / ZeRO-3: published {ptdp.published / zero3.published:.2f}, "
            f"planner {ptdp.as_paper_ran / zero3.as_paper_ran:.2f}"
        )
    return lines


def draw_figure_10(points: list[Figure10Point], path: str) -> str:
    """Both models side by side: TFLOP/s per GPU against GPUs, published (markers), planner (lines)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, model in zip(axes, MODELS):
        for scheme, color in (("PTD-P", "tab:orange"), ("ZeRO-3", "tab:blue")):
            series = sorted((p for p in points if p.model == model and p.scheme == scheme), key=lambda p: p.gpus)
            gpus = [p.gpus for p in series]
            ax.plot(gpus, [p.published for p in series], "o", color=color, label=f"{scheme}, paper")
            ax.plot(gpus, [p.as_paper_ran for p in series], "-", color=color, label=f"{scheme}, planner (as run)")
            ax.plot(gpus, [p.this_trainer for p in series], ":", color=color, label=f"{scheme}, planner (this trainer)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({p.gpus for p in points if p.model == model}))
        ax.get_xaxis().set_major_formatter(plt.ScalarFormatter())
        ax.set_xlabel("number of GPUs")
        ax.set_ylabel("TFLOP/s per GPU")
        ax.set_ylim(0, 240)
        ax.set_title(f"{model} parameters, batch fixed (Table 2)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path
