"""matplotlib for the planner's figures, imported on first use: the one place that imports it.

matplotlib.pyplot costs ~0.6 CPU s to import (measured after torch on the 2-core CPU machine) and only the
figure writers (tools/plan.py --plots, planner/figure_10.py) need it; the trainer imports planner/ for its
memory and FLOP estimates and must not pay for it.
"""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend (files only: no display is opened or needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot

    return matplotlib.pyplot
