"""The hang guard on two real processes (its own fork launcher: a rank here ends with os._exit, which a pooled
worker must not): rank 1's collective times out and it reports; rank 0, stuck outside any collective, is stopped
by its watchdog; both dump, exit 5, and tools/diagnose_hang.py names rank 0 and the call it never reached."""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from operations.guards import EXIT_HUNG
from operations.log import get_logger
from operations.watchdog import WATCHDOG_GRACE_S, HangGuard
from parallel.comm import CollectiveError
from parallel.comm_recorder import CommRecorder
from parallel.state import ParallelState
from tests.conftest import free_port
from tools import diagnose_hang

pytestmark = pytest.mark.tier("fast")

TIMEOUT_S = 2.0


def _rank(rank: int, world_size: int, port: int, run_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    state = ParallelState.create(tp_size=2, pp_size=1, recorder=CommRecorder())
    guard = HangGuard(60.0, TIMEOUT_S, run_dir, get_logger(rank))
    guard.start(state)
    guard.iteration_started(1)
    with state.comm.region("train", 1):
        state.comm.all_reduce(torch.ones(2), state.tp_group)
    guard.steady()  # a barrier, then the training timeout
    guard.iteration_started(2)
    with state.comm.region("boundary", 2):
        if rank == 0:
            time.sleep(60)  # stuck outside any collective: only the watchdog ends this
        try:
            state.comm.all_reduce(torch.ones(2), state.tp_group)
        except CollectiveError as err:
            os._exit(guard.collective_failed(err))


def test_a_timeout_and_a_watchdog_both_dump_and_exit_5(tmp_path, capfd):
    context = mp.start_processes(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=False, start_method="fork")
    started = time.monotonic()
    for process in context.processes:
        process.join(60)
    elapsed = time.monotonic() - started
    assert [process.exitcode for process in context.processes] == [EXIT_HUNG, EXIT_HUNG]
    assert elapsed < TIMEOUT_S + WATCHDOG_GRACE_S + 15  # start-up, the first iteration, the timeouts
    err = capfd.readouterr().err
    assert "error: rank 1 (tp 1, cp 0, dp 0, pp 0) at iteration 2: all_reduce #1 on group tp" in err
    assert "(parallel.train_timeout_s=2)" in err
    assert "error: rank 0 (tp 0, cp 0, dp 0, pp 0) at iteration 2: no progress for " in err
    assert "stopped by its watchdog" in err
    assert diagnose_hang.main([str(tmp_path)]) == 0
    out = capfd.readouterr().out
    assert (
        "rank 0 (tp 0, cp 0, dp 0, pp 0) did not reach all_reduce #1 (8 B, iteration 2, boundary) on tp [0, 1], "
        "which ranks 1 entered: it is stuck outside any collective (watchdog: "
    ) in out
    assert re.search(r"main thread at training/test_watchdog.py:\d+ in _rank", out)
