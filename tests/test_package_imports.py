"""The packages' imports, read from their source (every import statement, inside functions too): no import
cycle between modules, and the layering docs/architecture.md describes (arrows point one way; model/ and
compat/ never import torch.distributed; no package imports tools/, scripts/, tests/ or the entry point)."""

from __future__ import annotations

import ast
import os

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.tier("fast")

PACKAGES = (
    "compat",
    "config",
    "data",
    "model",
    "parallel",
    "optim",
    "checkpoint",
    "operations",
    "training",
    "planner",
    "convert",
    "evaluation",
)
# package -> the packages of ours it may import (its own modules aside)
ALLOWED = {
    "compat": set(),
    "data": set(),
    "model": {"compat"},
    "config": {"model", "data"},  # data only for data paths, lazily
    # data: the Microbatch record (context parallelism cuts it); config: the layout rules and RunShape read its
    # sections' own types (config imports only model/ and data/, so no cycle), not Protocols restating them
    "parallel": {"compat", "config", "model", "data"},
    "planner": {"config", "model", "parallel"},
    "optim": {"compat", "config", "model", "parallel"},
    "checkpoint": {"compat", "config", "data", "model", "optim", "parallel"},
    "operations": {"compat", "config", "data", "model", "parallel"},
    "training": {"checkpoint", "compat", "config", "data", "model", "operations", "optim", "parallel", "planner"},
    "convert": {"checkpoint", "compat", "config", "data", "model", "parallel"},
    "evaluation": {"checkpoint", "compat", "config", "convert", "data", "model", "operations", "parallel"},
}
NO_TORCH_DISTRIBUTED = ("compat", "model")
NEVER_IMPORTED = ("tools", "scripts", "tests", "pretrain_gpt")
# checkpoint/__init__.py is the checkpoint package's one public face: outside it (tests aside) no module is named
FACE_ONLY = "checkpoint"
# the programs and the entry point, which the face rule covers too
PROGRAMS = ("tools", "scripts", "pretrain_gpt.py")


def _modules(entries: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """{dotted module name: file path} of every module of the packages (or of `entries`: folders and files)."""
    modules = {}
    for entry in entries:
        if entry.endswith(".py"):
            modules[entry[:-3]] = os.path.join(REPO_ROOT, entry)
            continue
        for folder, _, files in os.walk(os.path.join(REPO_ROOT, entry)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, REPO_ROOT)[:-3].replace(os.sep, ".")
                    modules[dotted.removesuffix(".__init__")] = path
    return modules


def _imported_names(path: str, module: str, modules: dict[str, str]) -> set[str]:
    """Every dotted name `path` imports: `import a.b` gives a.b; `from a.b import c` gives a.b.c when c is a
    module of ours (importing it is what runs), else a.b; relative imports resolved."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + [base] if base else parts)
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return names


def _import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """({module: modules of ours it imports}, {module: every dotted name it imports})."""
    modules = _modules()
    edges, raw = {}, {}
    for module, path in modules.items():
        raw[module] = _imported_names(path, module, modules)
        targets = set()
        for name in raw[module]:
            while name and name not in modules:  # `import a.b.c` of a name below a module -> that module
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        edges[module] = targets
    return edges, raw


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_modules():
    edges, _ = _import_graph()
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_packages_import_only_downwards():
    edges, raw = _import_graph()
    wrong = []
    for module, targets in edges.items():
        package = module.split(".")[0]
        wrong += [f"{module} -> {t}" for t in targets if t.split(".")[0] not in ALLOWED[package] | {package}]
        wrong += [f"{module} -> {n}" for n in raw[module] if n.split(".")[0] in NEVER_IMPORTED]
        if package in NO_TORCH_DISTRIBUTED:
            wrong += [
                f"{module} -> {n}"
                for n in raw[module]
                if n == "torch.distributed" or n.startswith("torch.distributed.")
            ]
    assert wrong == []


def test_the_layering_table_covers_every_package():
    assert set(ALLOWED) == set(PACKAGES)
    assert {
        name for name in os.listdir(REPO_ROOT) if os.path.isfile(os.path.join(REPO_ROOT, name, "__init__.py"))
    } >= set(PACKAGES)


def test_only_the_checkpoint_face_is_imported_from_outside():
    modules = _modules()
    outside = {**modules, **_modules(PROGRAMS)}
    wrong = []
    for module, path in outside.items():
        if module.split(".")[0] == FACE_ONLY:
            continue
        names = _imported_names(path, module, modules)
        wrong += [f"{module} -> {name}" for name in sorted(names) if name.startswith(f"{FACE_ONLY}.")]
    assert wrong == []


def test_convert_and_evaluation_import_nothing_of_training():
    _, raw = _import_graph()
    wrong = [
        f"{module} -> {name}"
        for module, names in raw.items()
        if module.split(".")[0] in ("convert", "evaluation")
        for name in sorted(names)
        if name == "training" or name.startswith("training.")
    ]
    assert wrong == []


def test_the_checkpoint_face_gives_its_dcp_names_on_first_use():
    import checkpoint
    from checkpoint.dcp_planners import PiecesSavePlanner
    from checkpoint.dcp_reader import read_dcp_metadata

    assert checkpoint.read_dcp_metadata is read_dcp_metadata
    assert checkpoint.PiecesSavePlanner is PiecesSavePlanner
    assert [name for name in checkpoint.__all__ if not hasattr(checkpoint, name)] == []  # every name resolves
    with pytest.raises(AttributeError, match="has no attribute 'not_a_name'"):
        _ = checkpoint.not_a_name
