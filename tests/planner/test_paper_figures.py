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
CHECKED = ("11", "12", "13", "14", "15", "17", "18")  # the acceptance's figures plus 11 and 17's ratios


@pytest.mark.parametrize(
    "effect", [e for e in paper_figures.EFFECTS if e.figure in CHECKED], ids=lambda e: f"fig{e.figure}: {e.name}"
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
