"""`Any` only where a value really is arbitrary: at most ANY_BUDGET uses of the name outside tests (issue 28).

Counted from the tokens of every .py file of the packages, tools/, scripts/ and the entry point: each NAME token
`Any` outside an import statement (a `typing.Any` annotation, `dict[str, Any]`, a cast). The remaining ones are
decoded JSON / pickled values before they are checked, lm_eval's interface, Megatron's args; the check keeps new
code from reaching for `Any` where a type says what flows (ParallelState, a config section, a Protocol, object).
"""

from __future__ import annotations

import io
import os
import tokenize

import pytest

from tests.conftest import REPO_ROOT, SOURCE_ENTRIES, repo_python_files

pytestmark = pytest.mark.tier("fast")

ANY_BUDGET = 60


def any_names(source: str) -> int:
    """Uses of the name `Any` in `source`, import statements excluded."""
    count, in_import, line_start = 0, False, True
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if line_start and token.type == tokenize.NAME and token.string in ("import", "from"):
            in_import = True
        if token.type == tokenize.NEWLINE:
            in_import = False
        line_start = token.type in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT)
        if token.type == tokenize.NAME and token.string == "Any" and not in_import:
            count += 1
    return count


def test_any_names_counts_annotations_not_imports() -> None:
    source = (
        "from typing import Any\n"
        "import typing\n"
        "def f(x: Any, y: dict[str, Any]) -> typing.Any:\n"
        "    return x\n"
        "if True:\n"
        "    from typing import Any\n"
    )
    assert any_names(source) == 3


def test_any_stays_within_its_budget() -> None:
    per_file = {}
    for path in repo_python_files(SOURCE_ENTRIES):
        with open(path, encoding="utf-8") as handle:
            count = any_names(handle.read())
        if count:
            per_file[os.path.relpath(path, REPO_ROOT)] = count
    total = sum(per_file.values())
    worst = ", ".join(f"{name} {n}" for name, n in sorted(per_file.items(), key=lambda kv: -kv[1])[:8])
    assert total <= ANY_BUDGET, f"{total} uses of Any outside tests (budget {ANY_BUDGET}); most in: {worst}"
