"""Every relative link in README.md and docs/*.md points at a file that exists, and every #anchor at a heading
of that page (GitHub's anchor rule)."""

from __future__ import annotations

import os
import re

import pytest

pytestmark = pytest.mark.tier("fast")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(path: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    with open(path, encoding="utf-8") as handle:
        text = FENCE.sub("", handle.read())
    slugs = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        slugs.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return slugs


def relative_links(page: str) -> list[str]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as handle:
        text = FENCE.sub("", handle.read())
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (
            os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
        )
        if not os.path.exists(resolved):
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{page}: " + ", ".join(broken)


def test_readme_stays_short():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        assert len(handle.read().splitlines()) <= 150
