"""Every collective through the door: no torch.distributed collective or point-to-point call in the code base outside
parallel/comm.py and parallel/comm_recorder.py (tests aside), read from the source with ast, so that each one a
rank issues is in its records (parallel/comm_recorder.py) and bounded by the door's timeouts. Creating or
destroying process groups and asking for ranks are not collectives."""

from __future__ import annotations

import ast
import json
import os

import pytest
import torch

from operations.run_lock import RunLock, take_run_lock
from operations.startup import DistEnv, barrier
from parallel.comm import Collectives
from parallel.comm_recorder import CommRecorder
from tests.conftest import REPO_ROOT, run_ranks

pytestmark = pytest.mark.tier("fast")

# torch.distributed's collective and point-to-point functions (torch 2.11 to 2.13), by the name a call uses
COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_single",
        "all_reduce",
        "all_reduce_coalesced",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "irecv",
        "isend",
        "monitored_barrier",
        "recv",
        "recv_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "send_object_list",
    }
)
# modules whose every function is a collective (functional collectives, autograd-aware collectives)
COLLECTIVE_MODULES = ("torch.distributed._functional_collectives", "torch.distributed.nn")
DOOR = ("parallel/comm.py", "parallel/comm_recorder.py")
SKIPPED_FOLDERS = {"tests", ".git", "sample_data", "runs", ".mypy_cache", ".ruff_cache", "__pycache__", ".venv"}


def _source_files(root: str) -> list[str]:
    """Paths (relative to `root`) of every .py file of the code base outside tests/ and the door."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_FOLDERS and not d.startswith("."))
        for name in sorted(names):
            path = os.path.relpath(os.path.join(folder, name), root)
            if name.endswith(".py") and path not in DOOR:
                found.append(path)
    return found


def _distributed_aliases(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names bound to the torch.distributed module, names bound to the torch module) anywhere in `tree`."""
    modules, torches = set(), {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed" and alias.asname:
                    modules.add(alias.asname)
                elif alias.name == "torch" and alias.asname:
                    torches.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            modules.update(alias.asname or alias.name for alias in node.names if alias.name == "distributed")
    return modules, torches


def _is_distributed(node: ast.expr, modules: set[str], torches: set[str]) -> bool:
    """Whether `node` names the torch.distributed module (`dist`, `torch.distributed`)."""
    if isinstance(node, ast.Name):
        return node.id in modules
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "distributed"
        and isinstance(node.value, ast.Name)
        and node.value.id in torches
    )


def raw_collectives(source: str, path: str) -> list[str]:
    """'path:line: what' for each use of a torch.distributed collective in `source`: a call or a reference
    (`dist.isend` handed to P2POp is one), a `from torch.distributed import all_reduce`, an import of a
    module of functional collectives."""
    tree = ast.parse(source, path)
    modules, torches = _distributed_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in COLLECTIVES
            and _is_distributed(node.value, modules, torches)
        ):
            found.append(f"{path}:{node.lineno}: torch.distributed.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            names = sorted(alias.name for alias in node.names if alias.name in COLLECTIVES)
            found.extend(f"{path}:{node.lineno}: from torch.distributed import {name}" for name in names)
        if isinstance(node, ast.Import | ast.ImportFrom):
            imported = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in imported:
                if any(name == module or name.startswith(f"{module}.") for module in COLLECTIVE_MODULES):
                    found.append(f"{path}:{node.lineno}: import of {name}")
    return sorted(set(found), key=lambda line: int(line.split(":")[1]))


def test_no_raw_collective_outside_the_door():
    offenders = []
    for path in _source_files(REPO_ROOT):
        with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as handle:
            offenders += raw_collectives(handle.read(), path)
    assert not offenders, (
        "raw torch.distributed collectives outside parallel/comm.py (issue them through a Collectives: "
        "state.comm, or DistEnv.comm before a ParallelState exists):\n" + "\n".join(offenders)
    )


def test_the_scan_finds_each_way_of_reaching_a_collective():
    source = """
import torch
import torch.distributed as dist
import torch.distributed as td
from torch import distributed
from torch.distributed import all_gather_object, get_rank
import torch.distributed._functional_collectives as funcol

def f(x, ops):
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    torch.distributed.barrier()
    td.broadcast_object_list([x], src=0)
    distributed.monitored_barrier()
    issue = dist.isend
    dist.init_process_group("gloo"); dist.new_group([0]); dist.get_world_size(); dist.is_initialized()
    dist.destroy_process_group(); get_rank()
    x.all_reduce(); comm.barrier(); state.comm.all_gather_object([], x)
"""
    found = raw_collectives(source, "m.py")
    assert found == [
        "m.py:6: from torch.distributed import all_gather_object",
        "m.py:7: import of torch.distributed._functional_collectives",
        "m.py:10: torch.distributed.all_reduce",
        "m.py:11: torch.distributed.barrier",
        "m.py:12: torch.distributed.broadcast_object_list",
        "m.py:13: torch.distributed.monitored_barrier",
        "m.py:14: torch.distributed.isend",
    ]


def test_the_door_itself_is_what_the_scan_leaves_out():
    # the door issues the raw calls: the scan reads it as any other file would be read, and finds them
    with open(os.path.join(REPO_ROOT, "parallel", "comm.py"), encoding="utf-8") as handle:
        inside = raw_collectives(handle.read(), "parallel/comm.py")
    assert any(line.endswith("torch.distributed.batch_isend_irecv") for line in inside)
    assert "parallel/comm.py" not in _source_files(REPO_ROOT)
    assert "tools/generate.py" in _source_files(REPO_ROOT) and "pretrain_gpt.py" in _source_files(REPO_ROOT)


def _start_up_body(rank: int, world_size: int, run_dir: str, out_dir: str) -> None:
    env = DistEnv(
        world_size, rank, rank, world_size, torch.device("cpu"), comm=Collectives(CommRecorder(keep_all=True))
    )
    lock = RunLock(run_dir)
    assert take_run_lock(lock, env.rank, env.world_size, env.device, env.comm) is None
    barrier(env)  # no state yet: the world's door
    problem = ["rank 0's reason" if rank == 0 else ""]
    env.comm.broadcast_object_list(problem, src=0)
    assert problem == ["rank 0's reason"]
    assert env.comm.recorder is not None
    rows = [(r.kind, r.group, r.group_size, r.nbytes, r.seq, r.region, r.state) for r in env.comm.recorder.records()]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(rows, handle)
    env.comm.barrier()
    lock.release()


def test_the_start_up_collectives_are_recorded_by_the_world_door(tmp_path):
    run_ranks(2, _start_up_body, str(tmp_path / "run"), str(tmp_path))
    for rank in range(2):
        rows = [tuple(r) for r in json.loads((tmp_path / f"rank{rank}.json").read_text())]
        assert rows == [
            ("all_reduce", "world", 2, 8, 0, "startup", "completed"),  # the run lock's verdict (one int64)
            ("barrier", "world", 2, 0, 1, "startup", "completed"),
            ("broadcast_object_list", "world", 2, 0, 2, "startup", "completed"),
        ]
