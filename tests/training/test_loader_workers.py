"""operations/loader_workers.py: closing the stream stops its loader workers, which ignore SIGTERM (as the
trainer's do): an idle worker leaves at once through torch's shutdown, one stuck in a read is SIGKILLed."""

from __future__ import annotations

import os
import time
from typing import cast

import pytest
import torch

from operations.loader_workers import MicrobatchStream
from operations.preemption import ignore_stop_signals

pytestmark = pytest.mark.tier("fast")


class _Samples(torch.utils.data.Dataset):
    """Sample i is tensor([i]); from sample `stuck_from` on, a read never returns (a stalled file system)."""

    def __init__(self, stuck_from: int):
        self.stuck_from = stuck_from

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        while index >= self.stuck_from:
            time.sleep(3600)
        return torch.tensor([index])


def _stream(stuck_from: int) -> MicrobatchStream:
    loader = torch.utils.data.DataLoader(
        _Samples(stuck_from), batch_size=2, num_workers=1, worker_init_fn=ignore_stop_signals, prefetch_factor=2
    )
    return MicrobatchStream(lambda: iter(loader))


def _first_ids(stream: MicrobatchStream) -> list[list[int]]:
    """The next batch's sample ids (these loaders yield tensors of ids, not micro-batches)."""
    return cast(torch.Tensor, next(stream)).tolist()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_idle_worker_leaves_at_once_when_the_stream_closes():
    stream = _stream(stuck_from=64)
    assert _first_ids(stream) == [[0], [1]]
    (worker,) = stream.worker_pids
    started = time.monotonic()
    stream.close()
    assert not _alive(worker) and time.monotonic() - started < 4.0  # torch's shutdown, no wait for a timeout
    stream.close()  # twice is harmless


def test_a_worker_stuck_in_a_read_and_deaf_to_sigterm_is_killed():
    stream = _stream(stuck_from=2)
    assert _first_ids(stream) == [[0], [1]]  # the next batches' reads never return
    (worker,) = stream.worker_pids
    os.kill(worker, 15)
    time.sleep(0.2)
    assert _alive(worker)  # SIGTERM is ignored: what kept a crashed trainer waiting at exit
    started = time.monotonic()
    stream.close()
    # torch's shutdown waits 5 s for it, sends the ignored SIGTERM and waits 5 s more; then SIGKILL
    assert not _alive(worker) and time.monotonic() - started < 20.0


def test_a_stream_without_workers_closes_as_a_no_op():
    stream = MicrobatchStream(lambda: iter(torch.utils.data.DataLoader(_Samples(64), batch_size=2)))
    assert stream.worker_pids == [] and _first_ids(stream) == [[0], [1]]
    stream.close()
