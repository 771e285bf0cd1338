"""The straggler report's summary: slowest and fastest ranks with their coordinates, and the warning for a rank
persistently above its pipeline stage's median."""

import pytest

from operations.straggler import summarize
from parallel.rank_grid import RankGrid

pytestmark = pytest.mark.tier("fast")


def test_slowest_and_fastest_with_coordinates_and_a_warning_on_the_second_report_in_a_row():
    grid = RankGrid.megatron(dp=4)
    streaks: dict[int, int] = {}
    compute, wait = [100.0, 210.0, 104.0, 98.0], [110.0, 2.0, 107.0, 111.0]
    first = summarize((1, 10), compute, wait, grid, 0.2, streaks)
    assert first.record == {
        "iteration": 10,
        "straggler_slowest_rank": 1,
        "straggler_slowest_compute_ms": 210.0,
        "straggler_slowest_wait_ms": 2.0,
        "straggler_fastest_rank": 3,
        "straggler_fastest_compute_ms": 98.0,
        "straggler_fastest_wait_ms": 111.0,
        "straggler_median_compute_ms": 102.0,
    }
    assert first.line == (
        "stragglers over iterations 1-10 (per iteration): slowest rank 1 (tp 0, cp 0, dp 1, pp 0) compute 210.0 ms, "
        "wait 2.0 ms | fastest rank 3 (tp 0, cp 0, dp 3, pp 0) compute 98.0 ms, wait 111.0 ms | median compute 102.0 ms"
    )
    assert first.warnings == []  # once is not yet persistent
    second = summarize((11, 20), compute, wait, grid, 0.2, streaks)
    assert second.warnings == [
        "warning: rank 1 (tp 0, cp 0, dp 1, pp 0) is a straggler: compute 210.0 ms per iteration is 106% above its "
        "pipeline stage's median 102.0 ms in 2 reports in a row (logging.straggler_threshold=0.2): look at that node "
        "(thermal throttling, a shared or failing device, its data loader)"
    ]
    third = summarize((21, 30), [100.0, 101.0, 104.0, 98.0], wait, grid, 0.2, streaks)
    assert third.warnings == [] and streaks[1] == 0  # back in line: the count starts again


def test_pipeline_stages_are_compared_with_their_own_median():
    grid = RankGrid.megatron(dp=2, pp=2)  # ranks 0, 1 on stage 0; 2, 3 on stage 1 (the head: more work)
    streaks: dict[int, int] = {}
    for _ in range(2):
        summary = summarize((1, 5), [50.0, 52.0, 90.0, 91.0], [40.0, 38.0, 2.0, 1.0], grid, 0.2, streaks)
    assert summary.warnings == [] and summary.record["straggler_slowest_rank"] == 3
