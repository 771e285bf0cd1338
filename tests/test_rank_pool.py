"""The persistent rank pool behind run_ranks (tests/rank_pool.py): it keeps its processes between tests, puts
back what a body changed, reports a failing or hung rank with its traceback, and restarts after one."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import cast

import pytest
import torch
import torch.distributed as dist

from tests import rank_pool
from tests.conftest import _SessionPool, run_ranks

pytestmark = [
    pytest.mark.tier("fast"),
    pytest.mark.skipif(not rank_pool.pool_enabled(), reason="PTDP_RANK_POOL=0: no pool to test"),
]


def _write_pid(rank: int, world_size: int, out_dir: str, tag: str) -> None:
    """The pid of this rank's worker (the body runs in a fork of it)."""
    dist.all_reduce(torch.ones(1))  # a working process group
    with open(os.path.join(out_dir, f"{tag}.{rank}"), "w") as handle:
        handle.write(str(os.getppid()))


def _pids(out_dir, tag: str, world_size: int) -> list[int]:
    return [int((out_dir / f"{tag}.{rank}").read_text()) for rank in range(world_size)]


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 refuses this batch")
    dist.barrier()  # rank 0 waits here for a rank that never comes: the pool must not wait for the timeout


def _hang(rank: int, world_size: int) -> None:
    time.sleep(3600)


def _leave_a_thread(rank: int, world_size: int) -> None:
    threading.Thread(target=time.sleep, args=(60,), daemon=True, name="left-behind").start()


def _change_everything(rank: int, world_size: int, out_dir: str) -> None:
    os.environ["PTDP_LEFT_BEHIND"] = "1"
    os.chdir(out_dir)
    torch.set_num_threads(2)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234)
    signal.signal(signal.SIGUSR2, lambda *args: None)
    torch.cuda.current_device = lambda: "cpu"  # the megatron tests' kind of redirect
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.left_behind = True


def _report_state(rank: int, world_size: int, out_dir: str) -> None:
    state = {
        "env": os.environ.get("PTDP_LEFT_BEHIND"),
        "cwd": os.getcwd() == out_dir,
        "threads": torch.get_num_threads(),
        "dtype": str(torch.get_default_dtype()),
        "rng": torch.rand(1).item(),
        "usr2": signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL,
        "current_device": torch.cuda.current_device.__name__,
        "tensor_cuda": torch.Tensor.cuda.__name__,
        "left_behind": hasattr(torch.Tensor, "left_behind"),
        "worker": os.getppid(),
    }
    with open(os.path.join(out_dir, f"state.{rank}.json"), "w") as handle:
        json.dump(state, handle)


def _print_rank(rank: int, world_size: int) -> None:
    print(f"hello from rank {rank}", flush=True)


def test_the_same_processes_run_the_next_body(tmp_path):
    run_ranks(2, _write_pid, str(tmp_path), "first")
    run_ranks(2, _write_pid, str(tmp_path), "second")
    first = _pids(tmp_path, "first", 2)
    assert first == _pids(tmp_path, "second", 2) and os.getpid() not in first


def test_a_failing_rank_is_reported_and_the_pool_restarts(tmp_path):
    run_ranks(2, _write_pid, str(tmp_path), "before")
    began = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_ranks(2, _fail_on_rank_1, timeout=120.0)
    assert time.monotonic() - began < 60  # not the timeout: rank 0 is killed once rank 1 has reported
    report = str(failure.value)
    assert "test_a_failing_rank_is_reported_and_the_pool_restarts" in report
    rank_1 = report[report.index("--- rank 1 ---") :]  # rank 0 may report the broken barrier too
    assert "in _fail_on_rank_1" in rank_1 and "ValueError: rank 1 refuses this batch" in rank_1
    run_ranks(2, _write_pid, str(tmp_path), "after")  # later tests are not poisoned
    before, after = _pids(tmp_path, "before", 2), _pids(tmp_path, "after", 2)
    assert not set(before) & set(after)
    for pid in before:  # the failed set is gone with its bodies, not left waiting in a collective
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


def test_a_hung_rank_is_killed_at_the_timeout_with_its_stack(tmp_path):
    with pytest.raises(AssertionError) as failure:
        run_ranks(2, _hang, timeout=2.0)
    report = str(failure.value)
    assert "did not finish within 2.0 s" in report and "in _hang" in report
    run_ranks(2, _write_pid, str(tmp_path), "after")


def test_what_a_body_changes_is_put_back(tmp_path):
    run_ranks(2, _report_state, str(tmp_path))
    before = [json.loads((tmp_path / f"state.{rank}.json").read_text()) for rank in range(2)]
    run_ranks(2, _change_everything, str(tmp_path))
    run_ranks(2, _report_state, str(tmp_path))
    after = [json.loads((tmp_path / f"state.{rank}.json").read_text()) for rank in range(2)]
    assert after == before  # the same workers, and nothing of the changing body left
    assert before[0]["env"] is None and before[0]["threads"] == 1 and before[0]["dtype"] == "torch.float32"
    assert before[0]["rng"] == before[1]["rng"]  # every rank starts a body from the same RNG state, as a fork


def test_a_thread_a_body_leaves_ends_with_it(tmp_path):
    run_ranks(2, _write_pid, str(tmp_path), "before")
    run_ranks(2, _leave_a_thread)
    run_ranks(2, _write_pid, str(tmp_path), "after")
    assert _pids(tmp_path, "before", 2) == _pids(tmp_path, "after", 2)


def test_a_local_function_runs_on_forked_ranks(tmp_path):
    def local(rank: int, world_size: int) -> None:
        (tmp_path / f"local.{rank}").write_text(str(os.getppid()))

    assert rank_pool.picklable_body(local, ()) is None
    run_ranks(2, local)
    assert {int((tmp_path / f"local.{rank}").read_text()) for rank in range(2)} == {os.getpid()}


def test_what_ranks_print_reaches_the_test_output(capfd):
    run_ranks(2, _print_rank)
    out = capfd.readouterr().out
    assert "hello from rank 0" in out and "hello from rank 1" in out


def test_the_pool_is_the_sessions():
    assert _SessionPool.pool is not None


def _report_warmth(rank: int, world_size: int, out_dir: str) -> None:
    import gc
    import sys

    state = {"frozen": gc.get_freeze_count(), "dynamo": "torch._dynamo" in sys.modules}
    with open(os.path.join(out_dir, f"warmth.{rank}"), "w") as handle:
        json.dump(state, handle)


def test_bodies_start_warm_from_a_single_threaded_zygote(tmp_path):
    """rank_pool.warm_up ran in the zygote: bodies inherit torch._dynamo imported and the heap frozen out of the
    collector's reach, and the zygote is still one thread (forking a process with threads is unsafe)."""
    run_ranks(2, _report_warmth, str(tmp_path))
    for rank in range(2):
        state = json.loads((tmp_path / f"warmth.{rank}").read_text())
        assert state["dynamo"] and state["frozen"] > 100_000, state
    zygote_pid = _SessionPool.pool.zygote.pid
    assert len(os.listdir(f"/proc/{zygote_pid}/task")) == 1


class _FakeWorkers:
    """A RankWorkers stand-in that starts no process: it records its world size and whether it was closed."""

    def __init__(self, zygote, world_size: int):
        self.world_size, self.closed = world_size, False

    def run(self, payload: bytes, timeout: float, free_port) -> tuple[str | None, float, bool]:
        return None, 0.0, True

    def close(self) -> None:
        self.closed = True


def test_sets_past_the_cap_run_and_are_not_kept(monkeypatch):
    """At most MAX_RANKS idle workers: sets up to the cap stay for the next body; a set larger than the cap
    (32 ranks) is made after retiring the others and retired after its run."""
    monkeypatch.setattr(rank_pool, "RankWorkers", _FakeWorkers)
    pool = rank_pool.RankPool(zygote=None)  # type: ignore[arg-type]  # the fake workers fork nothing
    pool.run(8, b"", 1.0, lambda: 0)
    pool.run(4, b"", 1.0, lambda: 0)
    kept = {size: cast(_FakeWorkers, workers) for size, workers in pool.workers.items()}
    assert list(kept) == [8, 4]
    pool.run(2 * rank_pool.MAX_RANKS, b"", 1.0, lambda: 0)
    assert not pool.workers and all(workers.closed for workers in kept.values())


def test_reports_of_many_ranks_are_grouped_first_failure_first():
    """At 32 ranks a failure or a hang reports each distinct text once, under its ranks, the first to come first."""
    reports = [(5, "ValueError: the cause"), *((rank, "barrier broken") for rank in (0, 1, 2, 3, 4, 6, 7, 31))]
    assert rank_pool._grouped_reports(reports, " (note)") == (
        "--- rank 5 (note) ---\nValueError: the cause\n--- ranks 0-4, 6-7, 31 (note) ---\nbarrier broken"
    )
