"""Shared test helpers: a launcher that runs a function on N gloo ranks in forked processes.

Forking is used (not spawn) because it starts 8 ranks in a fraction of a second on 2 cores; each rank
gets one thread so that 8 ranks do not fight over the cores.
"""
import os
import socket
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


def free_port() -> int:
    """A TCP port that is free on localhost right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(rank: int, world_size: int, port: int, fn, args, error_queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:  # report every failure, assertion or not, to the parent
        error_queue.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, timeout: float = 300.0) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; re-raise the first rank's failure.

    `fn` must be a module-level function. Results come back through files or a queue passed in args.
    """
    ctx = mp.get_context("fork")
    error_queue = ctx.SimpleQueue()
    procs = mp.start_processes(_rank_entry, args=(world_size, free_port(), fn, args, error_queue),
                               nprocs=world_size, join=False, start_method="fork")
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


@pytest.fixture
def ranks():
    """Fixture form of `run_ranks` for tests that prefer injection."""
    return run_ranks
