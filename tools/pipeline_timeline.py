"""Simulate a pipeline schedule, print its bubble fraction and draw its timeline as a PNG.

    python tools/pipeline_timeline.py --pp 4 --microbatches 8 --vp 2 --schedule interleaved \\
        [--forward-cost 1 --backward-cost 2 [--weight-cost 1]] [--comm-cost 0.1 [--overlap]] [--output PNG] [--xmax 33]
    python tools/pipeline_timeline.py --pp 4 --microbatches 8 --compare 1f1b,interleaved:2,zb-h1,zb-v:2 \\
        --weight-cost 1 --output docs/timeline_p4_m8_compare.png

The timeline comes from the same action lists the executor runs (parallel/pipeline/schedules.py). Costs are
per whole stage per micro-batch (a chunk costs 1/vp of it). By default communication costs nothing and the
schedule alone sets the timeline: the bubble fraction (a rank's idle time divided by its ideal compute time)
is (p-1)/m for gpipe and 1f1b, (p-1)/(vp*m) for interleaved; zero bubble (zb-h1, zb-v) splits the backward
into B (input gradient) and W (weight gradient, --weight-cost of --backward-cost). Boxes have three colours:
F, B and W. --compare draws several schedules stacked on one time axis. With --comm-cost (per batch of messages) or
--overlap the executor's communication plan is simulated too (the planner's simulator, simulator.simulate with a
CommPlan): batches of sends and receives that complete together, and with --overlap computation while a batch is
in flight (parallel.overlap_p2p_comm).
Invalid input prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch

from parallel.layout import SCHEDULES, check_schedule
from parallel.pipeline.schedules import Op, unhandled_op
from parallel.pipeline.simulator import CommPlan, Timeline, simulate_schedule

HATCHES = ("", "//", "..", "xx", "\\\\", "oo")  # one per model chunk
DEFAULT_DIR = os.path.join("runs", "timeline")  # relative to where the tool runs, as run.dir
LEGEND = (
    (Op.FORWARD, "F: forward"),
    (Op.BACKWARD, "B: backward (zero bubble: input gradient)"),
    (Op.WEIGHT, "W: weight gradient"),
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel size p")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per iteration m")
    parser.add_argument("--vp", type=int, default=1, help="model chunks per rank (interleaved; zb-v: 2)")
    parser.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)}")
    parser.add_argument("--forward-cost", type=float, default=1.0, help="forward time of a stage")
    parser.add_argument("--backward-cost", type=float, default=2.0, help="backward time of a stage")
    parser.add_argument(
        "--weight-cost", type=float, default=None, help="the weight-gradient part of --backward-cost (default: half)"
    )
    parser.add_argument("--compare", default="", help="several schedules stacked, e.g. 1f1b,interleaved:2,zb-h1,zb-v:2")
    parser.add_argument("--comm-cost", type=float, default=0.0, help="time of one pipeline message")
    parser.add_argument("--overlap", action="store_true", help="compute while messages are in flight")
    parser.add_argument(
        "--output", default=None, help="PNG to write (default: runs/timeline/<schedule>_p<P>_m<M>_v<V>.png)"
    )
    parser.add_argument(
        "--xmax",
        type=float,
        default=None,
        help="time axis length (default: the makespan); one value for pictures compared side by side",
    )
    return parser.parse_args(argv)


def output_path(args: argparse.Namespace) -> str:
    """--output (its folder is created, as every tool's), or a file under runs/timeline/: never the working
    directory's top level."""
    if args.output is not None:
        return args.output
    name = "compare" if args.compare else args.schedule
    return os.path.join(DEFAULT_DIR, f"{name}_p{args.pp}_m{args.microbatches}_v{args.vp}.png")


def op_style(op: Op) -> tuple[str, str, str]:
    """(colour, label letter, label font weight) of an action's box: three colours, forward, backward (the
    whole one, or its input part under zero bubble) and weight-gradient."""
    match op:
        case Op.FORWARD:
            return "#7aa6d6", "F", "normal"
        case Op.BACKWARD | Op.BACKWARD_INPUT:
            return "#e8a05c", "B", "bold"
        case Op.WEIGHT:
            return "#7cc47c", "W", "normal"
        case _:
            unhandled_op(op)


def box_colour(chunk: int, op: Op) -> tuple[float, ...]:
    """The op's colour; later chunks paler."""
    pale = 0.3 * chunk / max(1, chunk + 1)  # blend later chunks towards white
    return tuple(min(1.0, c * (1 - pale) + pale) for c in to_rgb(op_style(op)[0]))


def draw_rows(ax: Axes, timeline: Timeline, title: str) -> None:
    """One row per rank, a box per action, labelled with its kind and micro-batch."""
    for event in timeline.events:
        action = event.action
        _, letter, weight = op_style(action.op)
        ax.barh(
            event.rank,
            event.end - event.start,
            left=event.start,
            height=0.8,
            color=box_colour(action.chunk, action.op),
            hatch=HATCHES[action.chunk % len(HATCHES)],
            edgecolor="black",
            linewidth=0.6,
        )
        ax.text(
            (event.start + event.end) / 2,
            event.rank,
            f"{letter}{action.microbatch + 1}",
            ha="center",
            va="center",
            fontsize=7,
            fontweight=weight,
            bbox=dict(boxstyle="square,pad=0.05", facecolor="white", edgecolor="none", alpha=0.6),
        )
    p = timeline.pp_size
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()  # rank 0 on top, as in the paper's figures
    ax.set_title(f"{title}; bubble fraction {timeline.bubble_fraction:.4f}", fontsize=9)


def draw(timelines: list[tuple[str, Timeline]], path: str, note: str = "", xmax: float | None = None) -> None:
    """The timelines stacked on one time axis (one each for --compare) running to `xmax` (default: the
    longest makespan), the figure's width in proportion, so pictures drawn with one xmax share a scale."""
    width = max([xmax or 0.0] + [t.makespan for _, t in timelines])
    rows = sum(t.pp_size for _, t in timelines)
    fig, axes = plt.subplots(
        len(timelines), 1, figsize=(max(8.0, width * 0.45), 1.2 + 0.5 * rows + 0.5 * len(timelines)), sharex=True
    )
    axes = list(axes) if len(timelines) > 1 else [axes]
    for ax, (schedule, timeline) in zip(axes, timelines):
        p, v, m = timeline.pp_size, timeline.vp_size, timeline.num_microbatches
        draw_rows(ax, timeline, f"{schedule}: p={p}, m={m}, vp={v}{note}")
        ax.set_xlim(0, width)  # one time axis for all
    axes[-1].set_xlabel("time (units of --forward-cost)")
    legend = [Patch(facecolor=op_style(op)[0], edgecolor="black", label=label) for op, label in LEGEND]
    vp = max(t.vp_size for _, t in timelines)
    legend += [
        Patch(facecolor="white", edgecolor="black", hatch=HATCHES[c % len(HATCHES)], label=f"chunk {c}")
        for c in range(vp if vp > 1 else 0)
    ]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))  # leave the bottom strip to the legend
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _compared(spec: str) -> list[tuple[str, int]]:
    """--compare "1f1b,interleaved:2,zb-h1,zb-v:2" -> [(schedule, vp), ...]."""
    pairs = []
    for item in spec.split(","):
        schedule, _, vp = item.partition(":")
        if vp and not vp.isdigit():
            raise ValueError(f"--compare entry {item!r}: the vp after ':' must be a number")
        pairs.append((schedule, int(vp or 1)))
    return pairs


MAX_DRAWN_STEPS = 2048  # pp x vp x micro-batches: --pp 16 --microbatches 128 takes ~45 s to draw on one core


def _check(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The (schedule, vp) pairs to draw; ValueError (LayoutError included) names a bad value."""
    pairs = _compared(args.compare) if args.compare else [(args.schedule, args.vp)]
    for schedule, vp in pairs:
        check_schedule(schedule, args.pp, vp, args.microbatches)
        if args.pp * vp * args.microbatches > MAX_DRAWN_STEPS:  # matplotlib draws a box per step: minutes past it
            raise ValueError(
                f"--pp {args.pp} x vp {vp} x --microbatches {args.microbatches} is more than the "
                f"{MAX_DRAWN_STEPS:,} forward steps a timeline draws: give fewer ranks or micro-batches"
            )
    for option in ("forward_cost", "backward_cost", "weight_cost", "comm_cost", "xmax"):
        value = getattr(args, option)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"--{option.replace('_', '-')} ({value}) must be a finite number")
    if args.xmax is not None and args.xmax <= 0:
        raise ValueError(f"--xmax ({args.xmax}) must be > 0")
    if args.forward_cost <= 0 or args.backward_cost <= 0:
        raise ValueError(f"--forward-cost ({args.forward_cost}) and --backward-cost ({args.backward_cost}) must be > 0")
    if args.weight_cost is not None and not 0 < args.weight_cost < args.backward_cost:
        raise ValueError(f"--weight-cost ({args.weight_cost}) must be > 0 and < --backward-cost ({args.backward_cost})")
    if args.comm_cost < 0:
        raise ValueError(f"--comm-cost ({args.comm_cost}) must be >= 0")
    return pairs


def _timeline(args: argparse.Namespace, schedule: str, vp: int) -> Timeline:
    comm = CommPlan(args.comm_cost, args.overlap) if args.comm_cost or args.overlap else None
    return simulate_schedule(
        schedule, args.pp, args.microbatches, vp, args.forward_cost, args.backward_cost, args.weight_cost, comm
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        pairs = _check(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    timelines = [(schedule, _timeline(args, schedule, vp)) for schedule, vp in pairs]
    for schedule, timeline in timelines:
        prefix = f"{schedule} " if args.compare else ""
        # Rounded so that exact fractions print plainly (0.1875, not 0.18750000000000003).
        print(f"{prefix}bubble fraction: {round(timeline.bubble_fraction, 10)}")
        print(f"{prefix}makespan: {round(timeline.makespan, 10)}")
    note = ""
    if args.comm_cost or args.overlap:
        note = f", message cost {args.comm_cost:g}" + (", overlapped" if args.overlap else "")
    path = output_path(args)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        draw(timelines, path, note, args.xmax)
    except OSError as error:
        print(f"error: cannot write {path}: {error.strerror}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
