"""The paper's figures as held-out checks (planner/paper_figures.py): no point here is used by any fit.

Every effect must have the published direction; effects with a published size (text, or read off a plot)
must also be within the tolerance their entry states (25% unless said). Figure 17's memory boundary: without
recomputation nothing above batch 8 fits in 80 GiB."""

import os

import pytest

from planner import paper_figures
from planner.cluster import load_cluster
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.tier("fast")

A100 = os.path.join(REPO_ROOT, "configs", "clusters", "dgx_a100_80gb.yaml")


@pytest.mark.parametrize("effect", paper_figures.EFFECTS, ids=lambda e: f"fig{e.figure}: {e.name}")
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


def test_points_run_as_the_sc21_scripts_ran_them():
    # Megatron-LM examples/academic_paper_scripts/sc21: run_figure_12/18.sh keep 2 of the 8 layers per stage
    # in a chunk, run_figure_16.sh is the 91B model (32 x 15360), run_figure_17.sh runs plain 1F1B
    by_name = {(e.figure, e.name): e for e in paper_figures.EFFECTS}
    interleaved = by_name[("18", "scatter/gather, interleaved, batch 60")].b.config()
    assert (interleaved.parallel.schedule, interleaved.parallel.vp_size) == ("interleaved", 4)
    fig16 = by_name[("16", "micro-batch 2 -> 8, batch 128")].b.config()
    assert (fig16.model.num_layers, fig16.model.hidden_size, fig16.train.micro_batch_size) == (32, 15360, 8)
    assert paper_figures.figure_17(8, "none").config().parallel.schedule == "1f1b"
