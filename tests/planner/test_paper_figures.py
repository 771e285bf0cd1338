"""The paper's figures as held-out checks (planner/paper_figures.py): no point here is used by any fit.

Every effect must have the published direction; effects with a published size (text, or read off a plot)
must also be within the tolerance their entry states (25% unless said). Figure 17's memory boundary: without
recomputation nothing above batch 8 fits in 80 GiB."""

import os

import pytest

from planner import paper_figures
from planner.cluster import load_cluster
from tests.conftest import REPO_ROOT

A100 = os.path.join(REPO_ROOT, "configs", "clusters", "dgx_a100_80gb.yaml")
# Known misses, direction right, size not (docs/performance.md, "The figures, held out"): Figure 14 at batch
# 32 (read ~90 -> ~40; the simulated bubble gives 0.65); Figure 15 at t 32 (tp over 4 nodes: the planner
# charges the network latency on every ring step, NCCL's tree across nodes needs fewer) and from batch 32 to
# 512 at d 32 (1.50 against ~2.2: the 16-bit gradient reduction assumed for the paper's software halves the
# all-reduce that dominates batch 32; with fp32 gradients it reads 1.84).
KNOWN_MISSES = {
    ("14", "p 2 -> 32 (t 1), batch 32"),
    ("15", "t 2 -> 32 (p 1), batch 512"),
    ("15", "batch 32 -> 512 at (t, d) (2, 32)"),
}


def _marked(effect):
    if (effect.figure, effect.name) in KNOWN_MISSES:
        return pytest.param(effect, marks=pytest.mark.xfail(strict=True, reason="known miss, see KNOWN_MISSES"))
    return effect


@pytest.mark.parametrize(
    "effect", [_marked(e) for e in paper_figures.EFFECTS], ids=lambda e: f"fig{e.figure}: {e.name}"
)
def test_published_effect_direction_and_size(effect):
    predicted = paper_figures.predicted_ratio(effect, load_cluster(A100))
    assert paper_figures.agrees(effect, predicted), (
        f"Figure {effect.figure} {effect.name}: predicted {predicted:.3f}, published {effect.ratio:.3f} "
        f"({effect.source}, tolerance {effect.tolerance:.0%})"
    )


def test_figure_17_no_recompute_stops_fitting_above_batch_8():
    cluster = load_cluster(A100)
    fits = {b: paper_figures.fits_without_recompute(b, cluster) for b in (1, 8, 16, 256)}
    assert fits == {1: True, 8: True, 16: False, 256: False}
