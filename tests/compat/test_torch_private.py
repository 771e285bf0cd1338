"""compat/torch_private.py: every private torch name it lists exists in the installed torch (an upgrade that
removes or renames one fails here, naming it), each accessor reaches it, and no other file of the project
(tests aside) names a private torch attribute."""

from __future__ import annotations

import ast
import os
import re
import sys
from datetime import timedelta

import pytest
import torch
from torch import nn

from compat import torch_private
from compat.torch_private import PRIVATE_NAMES, PrivateName, resolve
from tests.conftest import REPO_ROOT, SOURCE_ENTRIES, repo_python_files

pytestmark = pytest.mark.tier("fast")

SCANNED = tuple(entry for entry in SOURCE_ENTRIES if entry != "compat")  # compat/ is where they belong
PRIVATE_IN_TORCH_STRING = re.compile(r"\btorch(\.\w+)*\._[A-Za-z]")


@pytest.mark.parametrize("name", PRIVATE_NAMES, ids=lambda n: n.qualified)
def test_every_listed_name_exists_in_the_installed_torch(name: PrivateName):
    try:
        resolve(name)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"torch {torch.__version__} has no {name.qualified} ({err}): it was needed because {name.reason}")
    assert name.reason and name.public_replacement


def test_the_accessors_reach_the_private_names():
    assert torch_private.autograd_engine() is resolve(torch_private.AUTOGRAD_ENGINE).__self__
    assert torch_private.fused_sdp_choice() is resolve(torch_private.FUSED_SDP_CHOICE)
    assert torch_private.grouped_mm() is resolve(torch_private.GROUPED_MM)
    base = torch.arange(6.0)
    assert torch_private.is_view(base[2:]) is True and torch_private.is_view(base) is False
    tensors = [torch.randn(5, 3), torch.randn(7)]
    norms = torch_private.foreach_norm(tensors)
    assert all(torch.equal(n, torch.linalg.vector_norm(t)) for n, t in zip(norms, tensors))
    calls = []

    class Iterator:  # a multi-process DataLoader iterator's shutdown, as LOADER_SHUTDOWN names it
        def _shutdown_workers(self):
            calls.append("shutdown")

    assert resolve(torch_private.LOADER_SHUTDOWN).__name__ == "_shutdown_workers"
    assert torch_private.shutdown_loader_workers(Iterator()) and calls == ["shutdown"]
    assert not torch_private.shutdown_loader_workers(object())  # no workers (num_workers=0): nothing to stop


def test_a_group_timeout_is_set_through_the_public_setter_or_the_private_function(monkeypatch):
    calls = []

    class Group:  # a process group of a torch with the public setter
        def set_timeout(self, timeout):
            calls.append(("public", timeout))

    timeout = timedelta(seconds=7)
    assert torch_private.set_group_timeout(Group(), timeout) and calls == [("public", timeout)]
    import torch.distributed.distributed_c10d as c10d

    assert resolve(torch_private.SET_PG_TIMEOUT) is c10d._set_pg_timeout
    monkeypatch.setattr(c10d, "_set_pg_timeout", lambda t, group: calls.append(("private", t)))
    assert torch_private.set_group_timeout(object(), timeout) and calls[-1] == ("private", timeout)
    monkeypatch.delattr(c10d, "_set_pg_timeout")
    assert not torch_private.set_group_timeout(object(), timeout)


def test_the_dcp_allow_list_names_exist():
    for module, names in torch_private.dcp_metadata_classes().items():
        for name in names:
            assert isinstance(resolve(PrivateName(module, name, "", "")), type), (module, name)


def _torch_bound_names(tree: ast.AST) -> set[str]:
    """Names bound to torch or to something imported from it (`import torch.nn.functional as F`, ...)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            bound |= {a.asname or a.name for a in node.names}
    return bound


def _private(name: str) -> bool:
    return re.fullmatch(r"_[A-Za-z]\w*", name) is not None  # not a dunder, not "_" alone


def _torch_object_private_attributes() -> set[str]:
    """Private attributes of tensors, parameters and modules (`_base`, `_parameters`, ...), reached from any object."""
    module = nn.Linear(1, 1)
    found = dir(torch.Tensor) + dir(nn.Parameter(torch.zeros(1))) + dir(module) + list(vars(module))
    return {name for name in found if _private(name)}


def _torch_module_private_names() -> set[str]:
    """Private names defined in torch's modules (those DCP and serialization load too): a string naming one
    (`"_StorageInfo"` in an allow-list) names a private torch attribute."""
    import torch.distributed.checkpoint  # noqa: F401  (its modules hold names DCP's metadata pickles)

    names: set[str] = set()
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".")[0] == "torch" and module is not None and hasattr(module, "__dict__"):
            names |= {name for name in vars(module) if _private(name)}
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = [
        n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    return {
        id(n.body[0].value)
        for n in nodes
        if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
    }


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _import_hit(node: ast.Import | ast.ImportFrom) -> str | None:
    """A private component of a torch module imported, or of a name imported from one."""
    module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
    names = [module, *(a.name for a in node.names)] if module.startswith("torch") else [a.name for a in node.names]
    parts = [p for n in names if n.startswith("torch") or module.startswith("torch") for p in n.split(".")]
    return next((p for p in parts if _private(p)), None)


def _getattr_hit(node: ast.Call, torch_names: set[str], object_privates: set[str]) -> str | None:
    """getattr / hasattr of a private name on a torch object (or of a private attribute torch objects have)."""
    if not (isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and len(node.args) > 1):
        return None
    literal = node.args[1]
    if not (isinstance(literal, ast.Constant) and isinstance(literal.value, str) and _private(literal.value)):
        return None
    return literal.value if _root(node.args[0]) in torch_names or literal.value in object_privates else None


def private_torch_uses(path: str, object_privates: set[str], module_privates: set[str]) -> list[str]:
    """`file:line name` for each private torch name the file uses (docstrings and comments aside)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    torch_names, skipped_strings, found = _torch_bound_names(tree), _docstrings(tree), []
    in_fstrings = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    for node in ast.walk(tree):
        hit = None
        if isinstance(node, ast.Attribute) and _private(node.attr):
            hit = node.attr if _root(node) in torch_names or node.attr in object_privates else None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            hit = _import_hit(node)
        elif isinstance(node, ast.Call):
            hit = _getattr_hit(node, torch_names, object_privates)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped_strings:
            match = PRIVATE_IN_TORCH_STRING.search(node.value)  # "torch.serialization._get_layout"
            hit = match.group(0) if match else None
            if node.value in module_privates and id(node) not in in_fstrings:  # "_StorageInfo" in an allow-list
                hit = node.value
        if hit:
            found.append(f"{os.path.relpath(path, REPO_ROOT)}:{node.lineno} {hit}")
    return found


def _scanned_files() -> list[str]:
    return repo_python_files(SCANNED)


def test_no_private_torch_name_outside_the_compat_module():
    privates = _torch_object_private_attributes(), _torch_module_private_names()
    found = [hit for path in _scanned_files() for hit in private_torch_uses(path, *privates)]
    assert found == [], "private torch names belong in compat/torch_private.py"


def test_the_scan_finds_each_kind_of_use(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.serialization import _get_layout\n"
        "a = torch._foreach_norm\nb = getattr(torch.autograd.Variable, '_execution_engine', None)\n"
        "c = some_tensor._base\nd = dist.distributed_c10d._get_default_group()\n"
        "e = ('torch.serialization._get_layout',)\nf = self._own_attribute\ng = {'x': ('_StorageInfo',)}\n"
        "h = f'{name}_size'\n"
    )
    privates = _torch_object_private_attributes(), _torch_module_private_names()
    hits = sorted(h.split(" ")[1] for h in private_torch_uses(str(sample), *privates))
    expected = ["_StorageInfo", "_base", "_execution_engine", "_foreach_norm", "_get_default_group", "_get_layout"]
    assert hits == sorted([*expected, "torch.serialization._g"])
