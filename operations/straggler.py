"""The straggler report: which rank is slow, gathered every logging.straggler_interval iterations.

Each rank measures, per iteration, the time from taking its batch to the end of its optimizer step, and how much
of that it spent blocked in collectives and pipeline transfers (parallel/comm.py's recorder counts the seconds
the loop's thread waits in each call). The rest is its compute: data, forward, backward, optimizer. A slow rank
computes longer and waits less; its peers wait for it. Every interval one small all-gather over the world
(2 numbers per rank, recorded under region "report"; not training work, so planner/collectives.py does not list
it) brings the per-iteration means to the logging rank, which logs the slowest and the fastest rank with their
coordinates (console, metrics.jsonl and TensorBoard through training/logging.py's MetricsWriter) and warns about a
rank whose compute exceeds the median of its pipeline stage (stages do different work: the last one holds the
head and the loss) by more than logging.straggler_threshold in two reports in a row.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from operations.diagnostics import describe_rank
from parallel.rank_grid import MEGATRON_ORDER, RankGrid
from parallel.state import ParallelState

REPORTS_IN_A_ROW = 2  # how persistent a straggler must be before the warning


@dataclass
class StragglerSummary:
    """One report: per-rank mean compute and wait (ms per iteration), and what the logging rank says of it."""

    iteration: int
    compute_ms: list[float]
    wait_ms: list[float]
    record: dict[str, float] = field(default_factory=dict)
    line: str = ""
    warnings: list[str] = field(default_factory=list)


def summarize(
    iterations: tuple[int, int],
    compute_ms: list[float],
    wait_ms: list[float],
    grid: RankGrid,
    threshold: float,
    streaks: dict[int, int],
) -> StragglerSummary:
    """The report of `iterations` (first, last) from every rank's means; `streaks` (rank -> reports in a row
    above its stage's median by more than `threshold`) is updated."""
    first, iteration = iterations
    summary = StragglerSummary(iteration, compute_ms, wait_ms)
    ranks = range(len(compute_ms))
    slowest = max(ranks, key=lambda r: (compute_ms[r], -r))
    fastest = min(ranks, key=lambda r: (compute_ms[r], r))
    median = statistics.median(compute_ms)

    def who(rank: int) -> str:
        return describe_rank(rank, {dim: grid.coord(rank, dim) for dim in MEGATRON_ORDER})

    summary.record = {
        "iteration": iteration,
        "straggler_slowest_rank": slowest,
        "straggler_slowest_compute_ms": compute_ms[slowest],
        "straggler_slowest_wait_ms": wait_ms[slowest],
        "straggler_fastest_rank": fastest,
        "straggler_fastest_compute_ms": compute_ms[fastest],
        "straggler_fastest_wait_ms": wait_ms[fastest],
        "straggler_median_compute_ms": median,
    }
    summary.line = (
        f"stragglers over iterations {first}-{iteration} (per iteration): slowest {who(slowest)} "
        f"compute {compute_ms[slowest]:.1f} ms, wait {wait_ms[slowest]:.1f} ms | fastest {who(fastest)} compute "
        f"{compute_ms[fastest]:.1f} ms, wait {wait_ms[fastest]:.1f} ms | median compute {median:.1f} ms"
    )
    for stage in range(grid.size("pp")):
        members = [r for r in ranks if grid.coord(r, "pp") == stage]
        stage_median = statistics.median(compute_ms[r] for r in members)
        for rank in members:
            above = stage_median > 0 and compute_ms[rank] > stage_median * (1 + threshold)
            streaks[rank] = streaks.get(rank, 0) + 1 if above else 0
            if streaks[rank] >= REPORTS_IN_A_ROW:
                summary.warnings.append(
                    f"warning: {who(rank)} is a straggler: compute {compute_ms[rank]:.1f} ms per iteration is "
                    f"{100 * (compute_ms[rank] / stage_median - 1):.0f}% above its pipeline stage's median "
                    f"{stage_median:.1f} ms in {streaks[rank]} reports in a row (logging.straggler_threshold="
                    f"{threshold:g}): look at that node (thermal throttling, a shared or failing device, its data "
                    f"loader)"
                )
    return summary


class StragglerReport:
    """One rank's side: `begin()` / `end()` around each iteration, `report(iteration)` at the same place on
    every rank (the all-gather is collective); returns the summary on the logging rank when one is due."""

    def __init__(self, interval: int, threshold: float, state: ParallelState, device: torch.device):
        self.interval = interval if state.is_distributed else 0  # one process has no stragglers
        self.threshold, self.state, self.device = threshold, state, device
        self._compute = self._wait = 0.0
        self._iterations = 0
        self._started = self._waited_before = 0.0
        self._streaks: dict[int, int] = {}

    def _waited(self) -> float:
        recorder = self.state.comm.recorder
        return recorder.wait_seconds if recorder is not None else 0.0

    def begin(self) -> None:
        if self.interval:
            self._started, self._waited_before = time.perf_counter(), self._waited()

    def end(self) -> None:
        if self.interval:
            elapsed, waited = time.perf_counter() - self._started, self._waited() - self._waited_before
            self._compute += max(0.0, elapsed - waited)
            self._wait += waited
            self._iterations += 1

    def report(self, iteration: int) -> StragglerSummary | None:
        if not self.interval or iteration % self.interval or not self._iterations:
            return None
        state, measured = self.state, self._iterations
        mine = torch.tensor([self._compute, self._wait], dtype=torch.float64, device=self.device) * (1000.0 / measured)
        self._compute = self._wait = 0.0
        self._iterations = 0
        everyone = torch.empty(2 * state.world_size, dtype=torch.float64, device=self.device)
        with state.comm.region("report", iteration):
            state.comm.all_gather_into(everyone, mine)
        if state.rank != 0:
            return None
        rows = everyone.view(-1, 2).tolist()
        compute, wait = [row[0] for row in rows], [row[1] for row in rows]
        return summarize(
            (iteration - measured + 1, iteration), compute, wait, state.grid, self.threshold, self._streaks
        )
