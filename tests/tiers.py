"""The two test tiers: what `python -m pytest -q tests` (the README's command) runs, and what only the full
suite adds (docs/testing.md has the list and the reasons).

- **fast**: every unit test and at least one parity run (one process against the layout) for every parallel
  feature (FAST_PARITY below). A newcomer's first command: five minutes on two idle cores.
- **full**: what costs more than it tells a newcomer: the launch path (torchrun, signals, hangs, kill -9 during
  saves, SLURM, two nodes), the remaining parity combinations, the kernels' ahead-of-time compile table, the
  lm-evaluation-harness comparisons. It runs in CI (.ci/run) on every submission.

Each test file says its tier at its top, `pytestmark = pytest.mark.tier("fast")` (or "full"); a test or a
parametrized case may move to the other tier with its own `pytest.mark.tier(...)`, which wins (the closest
mark). A file without a tier fails the collection, so a test added later lands in one tier on purpose.

Which tests run (`--tier`):
- `fast`: the fast tier; the default when the command line names a folder (`pytest tests`) or nothing;
- `full`: both tiers, the whole suite: `python -m pytest -q tests --tier full`; the default when the command
  line names only files or test ids (`pytest tests/e2e/test_torchrun.py` runs what it names);
- `full-only`: what the fast tier leaves out (.ci/run runs the README's command, then this).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TIERS = ("fast", "full")
CHOICES = ("fast", "full", "full-only")
MARK = "tier"
# every item collected, before the tier's selection: tests that check the collection (test_parity_cases.py) read
# it instead of collecting again in a new process
COLLECTED = pytest.StashKey[list]()

# The parity runs the fast tier keeps, one (at least) per parallel feature: {feature: test id}. The contract test
# (tests/test_tiers.py) checks that each is collected and in the fast tier.
FAST_PARITY = {
    "tp + sp": "tests/e2e/test_layouts.py::test_layout_matches_single_process[tp2-sp]",
    "cp": "tests/e2e/test_context_parallel_layouts.py::test_context_parallel_matches_single_process[cp2]",
    "pp gpipe": "tests/e2e/test_layouts.py::test_layout_matches_single_process[pp2-gpipe]",
    "pp 1f1b": "tests/e2e/test_layouts.py::test_layout_matches_single_process[pp4-1f1b]",
    "pp interleaved": "tests/e2e/test_layouts.py::test_layout_matches_single_process[pp2-vp2]",
    "pp zb-h1": "tests/e2e/test_layouts.py::test_layout_matches_single_process[pp2-zb-h1]",
    "pp zb-v": "tests/e2e/test_layouts.py::test_layout_matches_single_process[pp2-zb-v]",
    "dp + distributed optimizer": "tests/e2e/test_layouts.py::test_layout_matches_single_process[dp2-distopt]",
    "FSDP": "tests/e2e/test_fsdp.py::test_fsdp_matches_single_process[fsdp-dp4]",
    "HSDP": "tests/e2e/test_fsdp.py::test_fsdp_matches_single_process[hsdp-2x2]",
    "8-rank PTD-P": "tests/e2e/test_layouts.py::test_layout_matches_single_process[tp2-pp2-dp2-zb-h1-sp-distopt]",
    # the MoE layer at ep 2 over two gloo ranks against one process (outputs, reduced gradients, the step); the
    # trainer's MoE layouts at moe_tiny's size cost 10-20 CPU s each: tests/e2e/test_moe_layouts.py, full tier
    "MoE expert parallelism": "tests/parallel/test_expert_parallel.py::test_moe_layer_with_ep_equals_one_process[ep2]",
}


def add_option(parser) -> None:
    """`--tier fast|full|full-only` (PTDP_TEST_TIER sets the default)."""
    parser.addoption(
        "--tier",
        choices=CHOICES,
        default=os.environ.get("PTDP_TEST_TIER") or None,
        help="fast: the README's tier (default for a folder); full: the whole suite (default for named files or "
        "test ids); full-only: what the fast tier leaves out (tests/tiers.py)",
    )


def register_mark(config) -> None:
    config.addinivalue_line("markers", 'tier(name): the test tier, "fast" or "full" (tests/tiers.py)')


def chosen_tier(config) -> str:
    """The --tier given, else fast for a folder (or nothing) on the command line, else full."""
    given = config.getoption("tier")
    if given:
        return given
    args = [str(arg).split("::")[0] for arg in config.args] or ["."]
    names_a_folder = any(os.path.isdir(os.path.join(str(config.invocation_params.dir), arg)) for arg in args)
    return "fast" if names_a_folder else "full"


def tier_of(item) -> str | None:
    """The item's tier: its closest `tier` mark (a case's, else its function's, else its module's)."""
    mark = item.get_closest_marker(MARK)
    if mark is None:
        return None
    return mark.args[0] if mark.args else mark.kwargs.get("name")


def collect_ids(files: list[str], tier: str) -> list[str]:
    """The test ids a new pytest process collects from `files` in `tier` (no -k or tier of this run applies)."""
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider"]
        + ["--tier", tier, *files],
        cwd=repo_root,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": repo_root, "PTDP_RANK_POOL": "0"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [line.strip() for line in out.stdout.splitlines() if "::" in line]


def collected_items(config) -> list:
    """Every item this session collected, whichever tier runs (the items before `select`)."""
    return config.stash.get(COLLECTED, [])


def runs_in(tier: str, chosen: str) -> bool:
    """Whether a test of `tier` runs when `chosen` was asked for."""
    return chosen == "full" or (chosen == "fast") == (tier == "fast")


def select(config, items: list) -> None:
    """Refuse a test without a tier (or with an unknown one); deselect the tests the chosen tier leaves out."""
    untiered = sorted({item.nodeid.split("::")[0] for item in items if tier_of(item) not in TIERS})
    if untiered:
        raise pytest.UsageError(
            'test files without a tier: add `pytestmark = pytest.mark.tier("fast")` (or "full") at their top '
            "(tests/tiers.py): " + ", ".join(untiered)
        )
    config.stash[COLLECTED] = list(items)
    chosen = chosen_tier(config)
    kept = [item for item in items if runs_in(tier_of(item), chosen)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if not runs_in(tier_of(item), chosen)])
        items[:] = kept


FULL = pytest.mark.tier("full")


def layout_case(case_id: str, *values, fast: set[str]):
    """A parametrized layout case: in the fast tier when its id is in `fast`, else in the full tier."""
    return pytest.param(*values, id=case_id, marks=() if case_id in fast else FULL)
