"""The tiers' contract (tests/tiers.py): every test file says its tier, every parallel feature keeps a parity run
in the fast tier, and `--tier` picks what it says."""

from __future__ import annotations

import ast
import os
import types

import pytest

from tests import tiers
from tests.conftest import REPO_ROOT
from tests.test_parity_cases import _plain_nodeid

pytestmark = pytest.mark.tier("fast")

TESTS_DIR = os.path.join(REPO_ROOT, "tests")


def _test_files() -> list[str]:
    found = []
    for folder, _, names in os.walk(TESTS_DIR):
        found += [os.path.join(folder, name) for name in names if name.startswith("test_") and name.endswith(".py")]
    return sorted(found)


def _module_tier(path: str) -> str | None:
    """The tier a file's module-level `pytestmark` names (alone or in a list), else None."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            marks = node.value.elts if isinstance(node.value, ast.List) else [node.value]
            for mark in marks:
                if (
                    isinstance(mark, ast.Call)
                    and ast.unparse(mark.func) == "pytest.mark.tier"
                    and mark.args
                    and isinstance(mark.args[0], ast.Constant)
                ):
                    return mark.args[0].value
    return None


def test_every_test_file_says_its_tier_at_its_top():
    missing = [os.path.relpath(path, REPO_ROOT) for path in _test_files() if _module_tier(path) not in tiers.TIERS]
    assert not missing, 'add `pytestmark = pytest.mark.tier("fast")` (or "full") to: ' + ", ".join(missing)


def _fast_tier_ids(request) -> set[str]:
    """The fast tier's test ids among FAST_PARITY's files: this session's when it ran the fast tier of the whole
    folder, else a collection in a new pytest process."""
    config = request.config
    whole_folder = [os.path.normpath(os.path.join(str(config.invocation_params.dir), str(a))) for a in config.args]
    if TESTS_DIR in whole_folder and not config.option.keyword and not config.option.markexpr:
        return {_plain_nodeid(item) for item in tiers.collected_items(config) if tiers.tier_of(item) == "fast"}
    files = sorted({nodeid.split("::")[0] for nodeid in tiers.FAST_PARITY.values()})
    return set(tiers.collect_ids(files, "fast"))


def test_every_parallel_feature_has_a_parity_run_in_the_fast_tier(request):
    fast = _fast_tier_ids(request)
    missing = {feature: nodeid for feature, nodeid in tiers.FAST_PARITY.items() if nodeid not in fast}
    assert not missing, f"parity runs not collected in the fast tier: {missing}"
    features = " ".join(tiers.FAST_PARITY)
    for feature in ("tp + sp", "cp", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "distributed optimizer"):
        assert feature in features
    assert {"FSDP", "HSDP", "8-rank PTD-P"} <= set(tiers.FAST_PARITY)


def _item(nodeid: str, *marks) -> types.SimpleNamespace:
    """A stand-in item whose closest tier mark is the first of `marks` (as a case's mark precedes its module's)."""
    marks = [mark.mark for mark in marks]
    return types.SimpleNamespace(
        nodeid=nodeid, get_closest_marker=lambda name: next((m for m in marks if m.name == name), None)
    )


def _config(tier: str | None, args: list[str]) -> types.SimpleNamespace:
    deselected: list = []
    return types.SimpleNamespace(
        stash={},
        getoption=lambda name: tier,
        args=args,
        invocation_params=types.SimpleNamespace(dir=REPO_ROOT),
        hook=types.SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)),
        deselected=deselected,
    )


@pytest.mark.parametrize(
    "tier,args,expected",
    [
        (None, ["tests"], ["fast", "case-fast"]),  # the README's command
        (None, [], ["fast", "case-fast"]),
        (None, ["tests/e2e/test_layouts.py"], ["fast", "full", "case-fast", "case-full"]),  # a file runs whole
        ("full", ["tests"], ["fast", "full", "case-fast", "case-full"]),
        ("full-only", ["tests"], ["full", "case-full"]),
        ("fast", ["tests/e2e/test_layouts.py::test_x"], ["fast", "case-fast"]),
    ],
)
def test_the_tier_chosen_keeps_its_tests(tier, args, expected):
    fast, full = pytest.mark.tier("fast"), pytest.mark.tier("full")
    items = [
        _item("tests/a.py::fast", fast),
        _item("tests/a.py::full", full),
        _item("tests/a.py::case-fast", fast, full),  # a case marked fast in a full module
        _item("tests/a.py::case-full", full, fast),
    ]
    config = _config(tier, args)
    tiers.select(config, items)
    assert [item.nodeid.split("::")[1] for item in items] == expected
    assert len(config.deselected) == 4 - len(expected)


def test_a_test_without_a_tier_stops_the_collection():
    items = [_item("tests/a.py::tiered", pytest.mark.tier("fast")), _item("tests/b.py::untiered")]
    with pytest.raises(pytest.UsageError, match="tests/b.py"):
        tiers.select(_config(None, ["tests"]), items)
