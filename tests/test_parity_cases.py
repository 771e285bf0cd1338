"""The layout / schedule / precision combinations compared against one process cannot shrink unnoticed.

Every test whose function name says it compares with one process (PARITY_WORDS) is a parity case; each
collected case (a node id, parametrization included) must be in tests/parity_cases.txt and each listed one
must still be collected. A case removed, renamed or parametrized away fails here; a new one asks to be listed.
Regenerate the list after a deliberate change with `python -m tests.test_parity_cases > tests/parity_cases.txt`.
"""

from __future__ import annotations

import ast
import os
import types

import pytest

from tests import tiers

pytestmark = pytest.mark.tier("fast")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
LIST_FILE = os.path.join(TESTS_DIR, "parity_cases.txt")
# a test function whose name holds one of these compares a layout, schedule or precision with one process
PARITY_WORDS = (
    "single_process",
    "one_process",
    "tracks_fp32",
    "at_another_layout",
    "matches_plain",
    "matches_off",
    "match_eager",
)


def is_parity_test(name: str) -> bool:
    return name.startswith("test_") and any(word in name for word in PARITY_WORDS)


def parity_files() -> list[str]:
    """Test files (relative to the repository) that define a parity test."""
    found = []
    for folder, _, names in os.walk(TESTS_DIR):
        for name in sorted(names):
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as handle:
                    tree = ast.parse(handle.read())
                if any(isinstance(node, ast.FunctionDef) and is_parity_test(node.name) for node in tree.body):
                    found.append(os.path.relpath(path, REPO_ROOT))
    return sorted(found)


def _function_name(nodeid: str) -> str:
    return nodeid.split("::")[-1].split("[")[0]


def collected_cases(files: list[str]) -> list[str]:
    """The parity node ids pytest collects from `files` (a separate process: no -k of this run applies)."""
    return sorted(nodeid for nodeid in tiers.collect_ids(files, "full") if is_parity_test(_function_name(nodeid)))


def _cases_of_this_session(request, files: list[str]) -> list[str] | None:
    """The parity cases of this pytest run when it collected all of `files` unfiltered (both tiers: what it collected before the tier's selection), else None."""
    option = request.config.option
    if option.keyword or option.markexpr or getattr(option, "deselect", None):
        return None
    if any("::" in str(arg) for arg in request.config.args):
        return None
    nodeids = [_plain_nodeid(item) for item in tiers.collected_items(request.config)]
    if not set(files) <= {nodeid.split("::")[0] for nodeid in nodeids}:
        return None
    return sorted(nodeid for nodeid in nodeids if is_parity_test(_function_name(nodeid)))


def _plain_nodeid(item) -> str:
    """The item's id without the "@group" xdist's loadgroup appends to the ids of grouped tests."""
    nodeid = item.nodeid
    for mark in item.iter_markers("xdist_group"):
        group = mark.args[0] if mark.args else mark.kwargs.get("name", "default")
        nodeid = nodeid.removesuffix(f"@{group}")
    return nodeid


def listed_cases() -> list[str]:
    with open(LIST_FILE, encoding="utf-8") as handle:
        return [line.strip() for line in handle if line.strip() and not line.startswith("#")]


def test_the_parity_cases_are_the_listed_ones(request):
    files = parity_files()
    cases = _cases_of_this_session(request, files) or collected_cases(files)
    listed = listed_cases()
    missing = sorted(set(listed) - set(cases))
    assert not missing, "parity cases no longer collected (restore them, or unlist them deliberately):\n" + "\n".join(
        missing
    )
    new = sorted(set(cases) - set(listed))
    assert not new, "new parity cases: add them to tests/parity_cases.txt:\n" + "\n".join(new)
    assert len(listed) == len(set(listed))


if __name__ == "__main__":
    print("# Layout / schedule / precision cases compared with one process (tests/test_parity_cases.py).")
    print("\n".join(collected_cases(parity_files())))


def test_a_grouped_id_is_read_without_its_xdist_group():
    """Under loadgroup xdist appends "@group" to the ids of grouped tests (test_checkpoint_layouts.py is one)."""
    group = "tests/e2e/test_checkpoint_layouts.py"
    item = types.SimpleNamespace(
        nodeid=f"{group}::test_resume_at_another_layout[tp4]@{group}",
        iter_markers=lambda name: [pytest.mark.xdist_group(group).mark] if name == "xdist_group" else [],
    )
    assert _plain_nodeid(item) == f"{group}::test_resume_at_another_layout[tp4]"
