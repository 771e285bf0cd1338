"""How the suite spreads over two workers (tests/xdist_setup.py): how many, and which tests share one."""

from __future__ import annotations

import os
import types

import pytest

from tests import xdist_setup

pytestmark = pytest.mark.tier("fast")


def _item(nodeid: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(nodeid=nodeid, path=os.path.join("/repo", nodeid.split("::")[0]))


def test_expensive_shared_fixtures_and_system_tests_keep_to_one_worker():
    assert xdist_setup.xdist_group_of(_item("tests/model/test_kernels_aot.py::test_x[80]")) == (
        "tests/model/test_kernels_aot.py"
    )
    assert xdist_setup.xdist_group_of(_item("tests/e2e/test_slurm.py::test_y")) == "system"
    assert xdist_setup.xdist_group_of(_item("tests/e2e/test_two_nodes.py::test_z")) == "system"
    assert xdist_setup.xdist_group_of(_item("tests/e2e/test_layouts.py::test_layout[tp2]")) is None
    # two modules built one session fixture (lm_eval's results) on both workers: one group
    evaluate = xdist_setup.xdist_group_of(_item("tests/evaluation/test_evaluate.py::test_a"))
    assert evaluate == xdist_setup.xdist_group_of(_item("tests/evaluation/test_cli.py::test_b")) == "harness_results"


@pytest.mark.parametrize(
    "capture,pdb,chosen,tier,expected",
    [
        ("fd", False, None, None, min(2, xdist_setup._usable_cores())),
        ("fd", False, None, "fast", min(2, xdist_setup._usable_cores())),
        ("fd", False, None, "full", 2 * xdist_setup._usable_cores()),
        ("fd", False, None, "full-only", 2 * xdist_setup._usable_cores()),
        ("no", False, None, "full", 0),
        ("fd", True, None, None, 0),
        ("fd", False, "3", "full", 3),
    ],
)
def test_the_number_of_workers(monkeypatch, capture, pdb, chosen, tier, expected):
    options = {"usepdb": pdb, "tier": tier}
    config = types.SimpleNamespace(
        option=types.SimpleNamespace(capture=capture), getoption=lambda name, default: options.get(name, default)
    )
    if chosen is None:
        monkeypatch.delenv("PTDP_TEST_WORKERS", raising=False)
    else:
        monkeypatch.setenv("PTDP_TEST_WORKERS", chosen)
    assert xdist_setup.pytest_xdist_auto_num_workers(config) == expected


def test_a_worker_runs_one_thread(request):
    """Under xdist (two workers on two cores) each worker is told OMP_NUM_THREADS=1 unless the user chose."""
    if not hasattr(request.config, "workerinput"):
        pytest.skip("not running under pytest-xdist")
    assert os.environ.get("OMP_NUM_THREADS")


def test_a_worker_groups_what_the_controller_grouped(request):
    """The worker parses the command line again: with the default two workers (loadgroup chosen by
    xdist_setup, not on the command line) it must still suffix grouped ids, or xdist spreads the group (as it
    did: the kernel table was compiled on both workers)."""
    if not hasattr(request.config, "workerinput"):
        pytest.skip("not running under pytest-xdist")
    if request.config.getvalue("loadgroup") is not True:
        pytest.fail("this worker does not group: the controller's loadgroup did not reach it")
    grouped = [item for item in request.session.items if xdist_setup.xdist_group_of(item) is not None]
    ungrouped = [item.nodeid for item in grouped if "@" not in item.nodeid]
    assert not ungrouped, f"grouped by xdist_group_of but without xdist's group suffix: {ungrouped[:10]}"
