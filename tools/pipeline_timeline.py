"""Simulate a pipeline schedule, print its bubble fraction and draw its timeline as a PNG.

    python tools/pipeline_timeline.py --pp 4 --microbatches 8 --vp 2 --schedule interleaved \\
        [--forward-cost 1 --backward-cost 2] [--comm-cost 0.1 [--overlap]] [--output PNG] [--xmax 33]

The timeline comes from the same action lists the executor runs (parallel/pipeline/schedules.py). Costs are
per whole stage per micro-batch (a chunk costs 1/vp of it). By default communication costs nothing and the
schedule alone sets the timeline: the bubble fraction (a rank's idle time divided by its ideal compute time)
is (p-1)/m for gpipe and 1f1b, (p-1)/(vp*m) for interleaved. With --comm-cost (per message) or --overlap the
executor's communication plan is simulated (simulator.simulate_plans): batches of sends and receives that
complete together, and with --overlap computation while a batch is in flight (parallel.overlap_p2p_comm).
Invalid input prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch

from parallel.layout import SCHEDULES, check_schedule
from parallel.pipeline.schedules import Op, build_schedule, unhandled_op
from parallel.pipeline.simulator import Timeline, simulate, simulate_plans

HATCHES = ("", "//", "..", "xx", "\\\\", "oo")  # one per model chunk
DEFAULT_DIR = os.path.join("runs", "timeline")  # relative to where the tool runs, as run.dir


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel size p")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per iteration m")
    parser.add_argument("--vp", type=int, default=1, help="model chunks per rank (interleaved only)")
    parser.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)}")
    parser.add_argument("--forward-cost", type=float, default=1.0, help="forward time of a stage")
    parser.add_argument("--backward-cost", type=float, default=2.0, help="backward time of a stage")
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
    os.makedirs(DEFAULT_DIR, exist_ok=True)
    return os.path.join(DEFAULT_DIR, f"{args.schedule}_p{args.pp}_m{args.microbatches}_v{args.vp}.png")


def op_style(op: Op) -> tuple[float, str]:
    """(shade, label font weight) of an action's box: backward boxes darker, their labels bold."""
    match op:
        case Op.FORWARD:
            return 1.0, "normal"
        case Op.BACKWARD:
            return 0.75, "bold"
        case _:
            unhandled_op(op)


def box_colour(microbatch: int, chunk: int, op: Op, num_microbatches: int) -> tuple[float, ...]:
    """Colour by micro-batch; backward darker than forward; later chunks paler."""
    palette = plt.get_cmap("tab10" if num_microbatches <= 10 else "tab20")
    red, green, blue = to_rgb(palette(microbatch % palette.N))
    shade = op_style(op)[0]
    pale = 0.3 * chunk / max(1, chunk + 1)  # blend later chunks towards white
    return tuple(min(1.0, c * shade * (1 - pale) + pale) for c in (red, green, blue))


def draw(timeline: Timeline, schedule: str, path: str, note: str = "", xmax: float | None = None) -> None:
    """One row per rank, a box per forward/backward, labelled with its micro-batch; the time axis runs to
    `xmax` (default: the makespan), the figure's width in proportion, so pictures drawn with one xmax share
    a scale."""
    p, v, m = timeline.pp_size, timeline.vp_size, timeline.num_microbatches
    xmax = max(xmax or 0.0, timeline.makespan)
    fig, ax = plt.subplots(figsize=(max(8.0, xmax * 0.45), 1.0 + 0.6 * p))
    for event in timeline.events:
        action = event.action
        ax.barh(
            event.rank,
            event.end - event.start,
            left=event.start,
            height=0.8,
            color=box_colour(action.microbatch, action.chunk, action.op, m),
            hatch=HATCHES[action.chunk % len(HATCHES)],
            edgecolor="black",
            linewidth=0.6,
        )
        weight = op_style(action.op)[1]
        ax.text(
            (event.start + event.end) / 2,
            event.rank,
            f"{action.op.value}{action.microbatch + 1}",
            ha="center",
            va="center",
            fontsize=7,
            fontweight=weight,
            bbox=dict(boxstyle="square,pad=0.05", facecolor="white", edgecolor="none", alpha=0.6),
        )
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()  # rank 0 on top, as in the paper's figures
    ax.set_xlim(0, xmax)
    ax.set_xlabel("time (units of --forward-cost / --backward-cost)")
    ax.set_title(
        f"{schedule}: p={p}, m={m}, vp={v}{note}; bubble fraction {timeline.bubble_fraction:.4f}"
        f"  (F = forward, B = backward, number = micro-batch)"
    )
    legend = [
        Patch(facecolor="lightgrey", edgecolor="black", label="F: forward"),
        Patch(facecolor="grey", edgecolor="black", label="B: backward (darker)"),
    ]
    if v > 1:
        legend += [
            Patch(facecolor="white", edgecolor="black", hatch=HATCHES[c % len(HATCHES)], label=f"chunk {c}")
            for c in range(v)
        ]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # leave the bottom strip to the legend
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_schedule(args.schedule, args.pp, args.vp, args.microbatches)
        if args.forward_cost <= 0 or args.backward_cost <= 0:
            raise ValueError(
                f"--forward-cost ({args.forward_cost}) and --backward-cost ({args.backward_cost}) must be > 0"
            )
        if args.comm_cost < 0:
            raise ValueError(f"--comm-cost ({args.comm_cost}) must be >= 0")
        path = output_path(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.comm_cost or args.overlap:
        lists = [build_schedule(args.schedule, args.pp, r, args.microbatches, args.vp) for r in range(args.pp)]
        timeline = simulate_plans(
            lists, args.vp, args.microbatches, args.forward_cost, args.backward_cost, args.comm_cost, args.overlap
        )
    else:
        timeline = simulate(args.schedule, args.pp, args.microbatches, args.vp, args.forward_cost, args.backward_cost)
    # Rounded so that exact fractions print plainly (0.1875, not 0.18750000000000003).
    print(f"bubble fraction: {round(timeline.bubble_fraction, 10)}")
    print(f"makespan: {round(timeline.makespan, 10)}")
    note = ""
    if args.comm_cost or args.overlap:
        note = f", message cost {args.comm_cost:g}" + (", overlapped" if args.overlap else "")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        draw(timeline, args.schedule, path, note, args.xmax)
    except OSError as error:
        print(f"error: cannot write {path}: {error.strerror}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
