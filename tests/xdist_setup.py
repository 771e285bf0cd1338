"""How `python -m pytest tests` spreads over the cores (pytest-xdist, requirements-dev.txt); conftest.py imports
these hooks. docs/testing.md has the measurements behind the choices.

- Two workers by default (`-n auto`, sized by `pytest_xdist_auto_num_workers`): most tests run one process with
  one thread, so one worker per core of a two-core machine roughly halves the wall time. More than two did not
  pay on two cores for the fast tier and a test's ranks already fill the cores of a bigger one. `--tier full`
  and `--tier full-only` get two workers per core: what the fast tier leaves out mostly waits (signals
  delivered and waited for, hangs waited out to their timeouts, SLURM's scheduler), and with two workers it
  kept the cores 52% busy (1,107 CPU s in 2,084 s). PTDP_TEST_WORKERS=N or `-n N`
  chooses; `-n 0` (or `-p no:xdist`) runs in one process, and so do `-s` and `--pdb` (their output must reach
  this terminal).
- OMP_NUM_THREADS=1 for the workers (unless set): two workers with two OpenMP threads each on two cores
  would spin against each other (docs/testing.md, GUIDE's thread notes).
- `--dist loadgroup`: a module whose tests share an expensive module-scoped fixture (SHARED_FIXTURE_MODULES:
  the compiled kernel table, a torchrun reference, trained checkpoints) runs on one worker, so the fixture is
  built once; the system tests (SLURM daemons, network namespaces) run one after another on one worker.
"""

from __future__ import annotations

import os

import pytest

# tests that start daemons or network namespaces of the machine: never two at once
SYSTEM_TEST_FILES = ("test_slurm.py", "test_slurm_two_nodes.py", "test_two_nodes.py")
DEFAULT_WORKERS = 2
FULL_TIER_WORKERS_PER_CORE = 2  # the full tiers wait more than they compute (module docstring)
LOADGROUP_SWITCH = "PTDP_XDIST_LOADGROUP"  # set by the controller for its workers
# Modules whose module-scoped fixture costs more than its tests would lose by running on one worker (CPU
# seconds of the fixture, measured with PTDP_TEST_COSTS: docs/testing.md). Cheaper ones are built on each
# worker that runs one of their tests: test_layouts.py's references (~1 s each) would otherwise put its 35
# tests on one worker.
SHARED_FIXTURE_MODULES = (
    "test_kernels_aot.py",  # compiled: model/kernels/aot_results.json (1 s), or 471 compiles when it is stale
    "test_torchrun_signals.py",  # reference: a torchrun run to compare the signalled ones with (29 s)
    "test_convert_megatron.py",  # megatron_dir: megatron-core checkpoints at three layouts (16 s)
    "test_checkpoint_layouts.py",  # saved_run: an 8-rank run whose checkpoint every test resumes (6.5 s)
)
# Modules whose tests must not run two at a time: each of test_scale.py's tests starts 32 ranks, and two at
# once (64 processes on 2 cores) would only wait on each other.
ONE_TEST_AT_A_TIME_MODULES = ("test_scale.py",)
# Modules that share an expensive session-scoped fixture run on one worker together, under one group name: the
# evaluation tests' harness_results (lm_eval over the exported model and the checkpoint, ~18 CPU s, and the
# lm_eval / transformers imports) was built on both workers.
SHARED_SESSION_FIXTURE_GROUPS = {
    "tests/evaluation/test_evaluate.py": "harness_results",
    "tests/evaluation/test_cli.py": "harness_results",
}


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config) -> None:
    """Turn on `-n auto --dist loadgroup` where pytest-xdist is installed and the command line did not choose."""
    option = config.option
    if not hasattr(option, "numprocesses"):
        return  # xdist not installed (or -p no:xdist)
    if hasattr(config, "workerinput"):
        # A worker parses the command line again, so it does not see the loadgroup chosen here: without its
        # `loadgroup` option it would not suffix the grouped tests' ids, and the groups would be spread.
        if os.environ.get(LOADGROUP_SWITCH) == "1":
            option.loadgroup = True
        return
    if option.numprocesses is None:
        option.numprocesses = "auto"
    if option.dist == "no":
        option.dist = "loadgroup"
    if option.dist == "loadgroup":
        os.environ[LOADGROUP_SWITCH] = "1"  # the workers start after this hook and inherit it
    if option.numprocesses != 0 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # the workers start after this hook and inherit it


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: PTDP_TEST_WORKERS, else two (one where there is one core), two per core for `--tier full` and
    `--tier full-only`; none with -s or --pdb."""
    if config.option.capture == "no" or config.getoption("usepdb", False):
        return 0
    chosen = os.environ.get("PTDP_TEST_WORKERS", "").strip()
    if chosen.isdigit():
        return int(chosen)
    if config.getoption("tier", None) in ("full", "full-only"):
        return FULL_TIER_WORKERS_PER_CORE * _usable_cores()
    return min(DEFAULT_WORKERS, _usable_cores())


def xdist_group_of(item) -> str | None:
    """The group an item's worker is chosen by: "system" for the system tests, its module for the modules of
    SHARED_FIXTURE_MODULES and ONE_TEST_AT_A_TIME_MODULES, the fixture's name for SHARED_SESSION_FIXTURE_GROUPS,
    None (any worker) otherwise."""
    name = os.path.basename(str(item.path))
    if name in SYSTEM_TEST_FILES:
        return "system"
    module = item.nodeid.split("::")[0]
    if module in SHARED_SESSION_FIXTURE_GROUPS:
        return SHARED_SESSION_FIXTURE_GROUPS[module]
    if name in SHARED_FIXTURE_MODULES or name in ONE_TEST_AT_A_TIME_MODULES:
        return module
    return None


def group_items(config, items) -> None:
    """Mark the items `xdist_group_of` groups (xdist's own hook then sends each group to one worker); conftest's
    pytest_collection_modifyitems calls it."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = xdist_group_of(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
