"""parallel/comm.py: the recorder's ring, sequence numbers and labels, the door's byte conventions on gloo, and what
a record says when a call completes, fails or times out."""

import json
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from parallel.comm import P2P, CollectiveError, Collectives
from parallel.comm_recorder import CommRecorder
from parallel.state import ParallelState
from tests.conftest import run_ranks

pytestmark = pytest.mark.tier("fast")


def test_recorder_keeps_a_bounded_ring_numbered_per_group_and_labelled():
    recorder = CommRecorder(capacity=3)
    with recorder.during("train", iteration=7):
        for _ in range(4):
            recorder.record("tp", 2, "all_reduce", 64)
        with recorder.during("checkpoint"):
            recorder.record("dp", 4, "all_gather", 128)
    recorder.record("tp", 2, "all_reduce", 8)
    latest = recorder.dump()
    assert len(latest) == 3  # the ring keeps the latest `capacity`
    assert [(r["group"], r["seq"], r["region"], r["iteration"]) for r in latest] == [
        ("tp", 3, "train", 7),
        ("dp", 0, "checkpoint", 7),  # a nested label keeps the iteration
        ("tp", 4, "startup", -1),  # labels come back after the block
    ]
    json.dumps(latest)  # plain data: what a hang report would write
    with pytest.raises(ValueError, match="keep_all"):
        recorder.records()
    everything = CommRecorder(capacity=1, keep_all=True)
    for _ in range(3):
        everything.record("pp", 2, "send", 4, peer=1)
    assert len(everything.records()) == 3 and len(everything.recent) == 1


def _door_body(rank: int, world_size: int, out_dir: str) -> None:
    recorder = CommRecorder(keep_all=True)
    state = ParallelState.create(tp_size=2, pp_size=1, recorder=recorder)  # world 4: tp 2 x dp 2
    comm = state.comm
    x = torch.ones(8)
    comm.all_reduce(x, state.tp_group)
    full = torch.empty(16)
    comm.all_gather_into(full, x, state.dp_group)  # 8 floats from each of 2 ranks
    shard = torch.empty(4)
    comm.reduce_scatter_into(shard, x, state.tp_group)
    comm.all_reduce(torch.ones(3, dtype=torch.int64))  # the default group: world
    peer = state.tp_ranks[1 - state.tp_rank]
    received = torch.empty(5)
    works = comm.batch_isend_irecv(
        [P2P("send", torch.full((5,), float(rank)), peer, state.tp_group), P2P("recv", received, peer, state.tp_group)]
    )
    for work in works:
        work.wait()
    assert received[0].item() == peer
    comm.all_reduce(x, state.tp_group)  # collectives count on: the sends and receives are numbered per peer
    comm.note("all_gather", 1024, state.dp_group)  # what an FSDP all-gather hook would record
    rows = [(r.kind, r.group, r.group_size, r.nbytes, r.seq, r.peer, r.state) for r in recorder.records()]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(rows, handle)
    dist.barrier()


def test_every_call_is_recorded_with_its_group_size_and_full_buffer_bytes(tmp_path):
    run_ranks(4, _door_body, str(tmp_path))
    rows = [tuple(r) for r in json.loads((tmp_path / "rank0.json").read_text())]
    assert rows == [
        ("all_reduce", "tp", 2, 32, 0, -1, "completed"),
        ("all_gather", "dp", 2, 64, 0, -1, "completed"),  # the gathered output
        ("reduce_scatter", "tp", 2, 32, 1, -1, "completed"),  # the scattered input
        ("all_reduce", "world", 4, 24, 0, -1, "completed"),
        ("send", "tp", 2, 20, 0, 1, "completed"),  # the first send to rank 1: rank 1's first receive from 0
        ("recv", "tp", 2, 20, 0, 1, "completed"),
        ("all_reduce", "tp", 2, 32, 2, -1, "completed"),
        ("all_gather", "dp", 2, 1024, 1, -1, "noted"),  # issued elsewhere: its completion is not seen here
    ]


def test_a_state_without_a_recorder_records_nothing():
    assert Collectives().recorder is None and ParallelState.single().comm.recorder is None


def test_the_dump_keeps_the_latest_record_of_each_group_after_the_ring_moved_on():
    recorder = CommRecorder(capacity=2)
    recorder.record("world", 4, "all_reduce", 24)
    for _ in range(5):
        recorder.record("tp", 2, "all_reduce", 64)
    recorder.record("pp", 2, "send", 8, peer=3)
    dumped = [(r["group"], r["seq"]) for r in recorder.dump()]
    assert dumped == [("world", 0), ("tp", 4), ("pp", 0)]  # in the order issued


def test_labels_and_waits_are_per_thread():
    recorder = CommRecorder()
    seen = {}

    def other() -> None:
        with recorder.during("checkpoint", 7):
            seen["labels"] = (recorder.region, recorder.iteration)
            entry = recorder.record("checkpoint", 4, "all_gather_object", 0)
            recorder.finish(entry, time.perf_counter() - 0.5)
        seen["wait"] = recorder.wait_seconds

    with recorder.during("train", 3):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert (recorder.region, recorder.iteration) == ("train", 3)  # the other thread's labels are its own
    assert seen["labels"] == ("checkpoint", 7) and seen["wait"] >= 0.5
    assert recorder.wait_seconds == 0.0 and recorder.activity == 2


def _timeout_body(rank: int, world_size: int, out_dir: str) -> None:
    recorder = CommRecorder()
    state = ParallelState.create(tp_size=2, pp_size=1, recorder=recorder)  # world 4: tp 2 x dp 2
    comm = state.comm
    comm.set_timeout(1.0, names=["tp", "dp"])  # the world keeps torch's: run_ranks' last barrier uses it
    outcome = {}
    if rank == 0:
        started = time.perf_counter()
        try:
            comm.all_reduce(torch.ones(4), state.tp_group)  # rank 1 never joins
        except CollectiveError as err:
            outcome["collective"] = (str(err), time.perf_counter() - started, err.record.state)
        # a timed-out group is broken for good: the receive goes over the other group (from rank 2)
        works = comm.batch_isend_irecv([P2P("recv", torch.empty(2), 2, state.dp_group)])  # nobody sends
        started = time.perf_counter()
        try:
            works[0].wait()
        except CollectiveError as err:
            outcome["recv"] = (str(err), time.perf_counter() - started, err.record.state)
        with open(os.path.join(out_dir, "outcome.json"), "w", encoding="utf-8") as handle:
            json.dump(outcome, handle)
    time.sleep(5)  # rank 1 stays until rank 0 has timed out twice; then neither touches the group again


def test_a_call_that_times_out_names_itself_and_its_record_says_failed(tmp_path):
    run_ranks(4, _timeout_body, str(tmp_path))
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    message, seconds, record_state = outcome["collective"]
    assert message.startswith("all_reduce #0 on group tp (2 ranks, 16 B, iteration -1, startup) failed after ")
    assert "Timed out" in message and 0.9 < seconds < 4.0 and record_state == "failed"
    message, seconds, record_state = outcome["recv"]  # gloo's receive has no timeout of its own: the door's
    assert message.startswith("recv #0 on group dp (2 ranks, peer rank 2, 8 B") and record_state == "failed"
    assert 0.9 < seconds < 4.0


def test_a_call_left_out_by_the_hook_is_not_issued_nor_recorded():
    comm = Collectives(CommRecorder(keep_all=True))
    seen = []
    comm.before_issue = lambda kind, group, async_op: seen.append((kind, group, async_op)) and False
    tp_group = object()  # torch.distributed is not even initialised here: nothing is issued
    comm.register(tp_group, "tp", 2)
    assert comm.all_reduce(torch.ones(2), tp_group) is None and seen == [("all_reduce", "tp", False)]
    assert comm.recorder is not None and comm.recorder.records() == []
