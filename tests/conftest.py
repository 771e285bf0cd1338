"""Shared test helpers: a launcher that runs a function on N gloo ranks, the tiny corpus, trainer arguments.

`run_ranks` sends the function to persistent rank processes (tests/rank_pool.py: started once per world size,
restarted after a failure) and falls back to forking fresh ones (not spawn: 8 ranks start in a fraction of a
second on 2 cores) where the function cannot travel there. Each rank gets one thread so that 8 ranks do not
fight over the cores.
"""

import os
import socket
import subprocess
import sys
import time
import traceback

# The fused kernels (model/kernels) run on CPU tensors in Triton's interpreter. Triton reads this when it is
# first imported (anything may import it: torch.compile, the kernels), so set it before any import. A CUDA run
# (scripts/gpu_check.sh) sets TRITON_INTERPRET=0 to test the compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.distributed as dist

# What the trainer imports only when a run needs it (a checkpoint, FSDP, a dataset blend: `import pretrain_gpt`
# leaves them out, tests/test_start_up_imports.py). The tests' forked ranks and command lines inherit this
# process's modules: imported here once, so that each forked rank that saves does not import DCP (~1.3 CPU s).
import torch.distributed.checkpoint
import torch.distributed.fsdp  # noqa: F401
import torch.multiprocessing as mp

import data.blend_index  # noqa: F401
from data.sample_corpus import build_tiny_corpus
from tests import cli_runner, rank_pool, tiers, xdist_setup
from tests.xdist_setup import (  # noqa: F401 - pytest hooks: two workers, OMP_NUM_THREADS=1
    pytest_cmdline_main,
    pytest_xdist_auto_num_workers,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


# Our source outside tests: what the source scans (private torch names, the Any budget) read.
SOURCE_ENTRIES = (
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
    "tools",
    "scripts",
    "pretrain_gpt.py",
)


def repo_python_files(entries: tuple[str, ...]) -> list[str]:
    """Every .py file of `entries` (folders, walked, and files), relative to the repository root, as paths."""
    files = []
    for entry in entries:
        path = os.path.join(REPO_ROOT, entry)
        if os.path.isfile(path):
            files.append(path)
        for folder, _, names in os.walk(path):
            files += [os.path.join(folder, name) for name in names if name.endswith(".py")]
    return sorted(files)


def system_tests_enabled() -> bool:
    """Tests that change the machine (install slurm-wlm with apt, start daemons, create network namespaces)
    run only when PTDP_SYSTEM_TESTS=1 (.ci/run sets it): a user's `pytest tests` does not do that."""
    return os.environ.get("PTDP_SYSTEM_TESTS") == "1"


def free_port() -> int:
    """A TCP port that is free on localhost right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(rank: int, world_size: int, port: int, fn, args, error_queue) -> None:
    try:
        rank_pool.join_ranks(rank, world_size, port)
        fn(rank, world_size, *args)
        if dist.is_initialized():  # fn may have torn the group down itself (pretrain_gpt.main does)
            dist.barrier()
    except BaseException:  # report every failure, assertion or not, to the parent
        error_queue.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _SessionPool:
    """The rank pool of this pytest process (one per xdist worker), made after collection, before any test
    has run (tests/rank_pool.py: fork safety). A plain holder: the process is its scope."""

    pool: rank_pool.RankPool | None = None


def run_ranks(world_size: int, fn, *args, timeout: float = 300.0) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; re-raise the failing ranks' tracebacks.

    `fn` should be a module-level function and args picklable: then the persistent rank pool runs it (a fresh
    default process group per call, the process's state put back after it). Otherwise (or PTDP_RANK_POOL=0)
    fresh processes are forked. Results come back through files (a queue passed in args forces the fork).
    """
    pool = _SessionPool.pool
    payload = rank_pool.picklable_body(fn, args) if pool is not None else None
    if pool is not None and payload is not None:
        pool.run(world_size, payload, timeout, free_port)
        return
    run_forked_ranks(world_size, fn, *args, timeout=timeout)


def run_forked_ranks(world_size: int, fn, *args, timeout: float = 300.0) -> None:
    """`run_ranks` on processes forked from this one for this call (fn and args travel by fork, not pickle)."""
    ctx = mp.get_context("fork")
    error_queue = ctx.SimpleQueue()
    procs = mp.start_processes(
        _rank_entry,
        args=(world_size, free_port(), fn, args, error_queue),
        nprocs=world_size,
        join=False,
        start_method="fork",
    )
    try:
        deadline = time.monotonic() + timeout
        while not procs.join(timeout=5.0):
            if time.monotonic() > deadline:
                for proc in procs.processes:
                    proc.kill()
                raise AssertionError(f"ranks did not finish within {timeout} s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        messages = []
        while not error_queue.empty():
            rank, tb = error_queue.get()
            messages.append(f"--- rank {rank} ---\n{tb}")
        raise AssertionError("\n".join(messages) or str(exc)) from None


def pytest_addoption(parser) -> None:
    tiers.add_option(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """The chosen tier's tests (tests/tiers.py), then xdist's groups (tests/xdist_setup.py) of what is left."""
    tiers.select(config, items)
    xdist_setup.group_items(config, items)


def pytest_configure(config) -> None:
    """The tier mark; PTDP_TEST_COSTS=<file> records each test's CPU seconds by cause (tests/cpu_costs.py,
    docs/testing.md)."""
    from tests.cpu_costs import recorder_for

    tiers.register_mark(config)
    recorder = recorder_for(config)
    if recorder is not None:
        config.pluginmanager.register(recorder, "ptdp_cpu_costs")


def _runs_tests_here(config) -> bool:
    """False in pytest-xdist's controller (its workers run the tests, each with a pool of its own)."""
    return hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)


def pytest_collection_finish(session) -> None:
    """Fork the rank pool's zygote now: every test module is imported (its workers inherit them, and what
    rank_pool.warm_up adds) and no test has run yet (no OpenMP threads, no gloo: safe to fork)."""
    if rank_pool.pool_enabled() and _runs_tests_here(session.config) and _SessionPool.pool is None:
        rank_pool.warm_up()
        _SessionPool.pool = rank_pool.RankPool(rank_pool.Zygote())
        recorder = session.config.pluginmanager.get_plugin("ptdp_cpu_costs")
        if recorder is not None:
            _SessionPool.pool.report_cpu = recorder.add_pool_cpu


def pytest_sessionfinish(session) -> None:
    if _SessionPool.pool is not None:
        _SessionPool.pool.close()
        _SessionPool.pool = None


@pytest.fixture
def ranks():
    """Fixture form of `run_ranks` for tests that prefer injection."""
    return run_ranks


@pytest.fixture
def marker(tmp_path) -> str:
    """Where a crafted pickle of tests/payloads.py creates its file if anything runs it (checked live first)."""
    from tests.payloads import assert_payload_is_live

    path = str(tmp_path / "payload_ran")
    assert_payload_is_live(path)
    return path


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> dict:
    """Session-wide tiny corpus for trainer tests."""
    return build_tiny_corpus(str(tmp_path_factory.mktemp("tiny_corpus")))


def tiny_train_args(corpus: dict, run_dir: str, *extra: str) -> list[str]:
    """pretrain_gpt.py arguments for a seconds-long fp32 run on the tiny corpus (dropout 0: parity-ready)."""
    return [
        f"data.data_path=[{corpus['data_prefix']}]",
        f"data.vocab_file={corpus['vocab_file']}",
        f"data.merge_file={corpus['merge_file']}",
        "data.num_workers=0",
        "model.num_layers=4",
        "model.hidden_size=32",
        "model.num_attention_heads=4",
        "model.seq_length=32",
        "model.hidden_dropout=0.0",
        "model.attention_dropout=0.0",
        "model.make_vocab_size_divisible_by=8",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "train.train_iters=10",
        "train.eval_interval=5",
        "train.eval_iters=2",
        "optim.lr_warmup_iters=2",
        "logging.log_interval=1",
        "logging.tensorboard=false",
        "checkpoint.save_interval=0",
        f"run.dir={run_dir}",
        *extra,
    ]


def read_metrics(run_dir: str) -> list[dict]:
    """The training lines (those with lm_loss) of a run's metrics.jsonl."""
    import json

    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        return [r for r in map(json.loads, handle) if "lm_loss" in r]


def assert_entry_points_refuse(overrides: list[str], world_size: int, expected: str, run_dir: str) -> None:
    """pretrain_gpt.py (at this world size) and tools/model_stats.py both exit 2 with the one line
    `error: <expected>` for these overrides of configs/gpt_tiny.yaml, and no run folder is made."""
    env = {**os.environ, "WORLD_SIZE": str(world_size)}
    trainer = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *overrides, f"run.dir={run_dir}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    stats = cli_runner.run_cli(  # the tool forked; the trainer's entry point is what the launch tests check
        [sys.executable, "tools/model_stats.py", "--config", "configs/gpt_tiny.yaml", "model.vocab_size=257"]
        + list(overrides),
        cwd=REPO_ROOT,
    )
    for result in (trainer, stats):
        assert result.returncode == 2 and result.stderr.strip() == f"error: {expected}", result.stderr
    assert not os.path.exists(run_dir)
