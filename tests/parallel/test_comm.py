"""parallel/comm.py: the recorder's ring, sequence numbers and labels, and the door's byte conventions on gloo."""

import json
import os

import pytest
import torch
import torch.distributed as dist

from parallel.comm import P2P, Collectives, CommRecorder
from parallel.state import ParallelState
from tests.conftest import run_ranks


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
    comm.note("all_gather", 1024, state.dp_group)  # what an FSDP all-gather hook would record
    rows = [(r.kind, r.group, r.group_size, r.nbytes, r.seq, r.peer) for r in recorder.records()]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(rows, handle)
    dist.barrier()


def test_every_call_is_recorded_with_its_group_size_and_full_buffer_bytes(tmp_path):
    run_ranks(4, _door_body, str(tmp_path))
    rows = [tuple(r) for r in json.loads((tmp_path / "rank0.json").read_text())]
    assert rows == [
        ("all_reduce", "tp", 2, 32, 0, -1),
        ("all_gather", "dp", 2, 64, 0, -1),  # the gathered output
        ("reduce_scatter", "tp", 2, 32, 1, -1),  # the scattered input
        ("all_reduce", "world", 4, 24, 0, -1),
        ("send", "tp", 2, 20, 2, 1),
        ("recv", "tp", 2, 20, 3, 1),
        ("all_gather", "dp", 2, 1024, 1, -1),
    ]


def test_a_state_without_a_recorder_records_nothing():
    assert Collectives().recorder is None and ParallelState.single().comm.recorder is None
