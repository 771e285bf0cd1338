"""tools/diagnose_hang.py on hand-made dumps: a rank stuck outside any collective, a rank that skipped one, calls
that differ at one sequence number, a receive whose send never came, a rank without a dump, bad input, two
attempts' dumps in one folder and dumps a restart moved to diagnostics.N."""

import json
import os

import pytest

from operations.diagnostics import FORMAT_VERSION, diagnostics_dir, dump_stem, set_aside_previous
from tools import diagnose_hang

pytestmark = pytest.mark.tier("fast")


def record(order, group, seq, kind, iteration, region, state="completed", nbytes=24, peer=-1, error=""):
    return dict(
        order=order, group=group, seq=seq, kind=kind, nbytes=nbytes, iteration=iteration, region=region, peer=peer,
        state=state, group_size=4, started=0.0, wait_s=0.0, error=error,
    )  # fmt: skip


def write(run_dir, rank, records, cause="timeout", stacks="", world=4, groups=None, **more):
    """A dump of a tp2 x pp2 rank (tp varies fastest): its groups from the rank order; `more` adds or replaces
    fields (the attempt: run, run_started)."""
    tp_rank, pp_rank = rank % 2, rank // 2
    groups = groups or {
        "world": list(range(world)),
        "tp": [2 * pp_rank, 2 * pp_rank + 1],
        "pp": [tp_rank, tp_rank + 2],
    }
    dump = {
        "format": FORMAT_VERSION,
        "rank": rank,
        "world_size": world,
        "coords": {"tp": tp_rank, "cp": 0, "dp": 0, "pp": pp_rank},
        "groups": groups,
        "iteration": 5,
        "cause": cause,
        "reason": "",
        "records": records,
        "threads": {"0x00007f0000000001": "MainThread"},
        "stacks": stacks,
        **more,
    }
    os.makedirs(diagnostics_dir(run_dir), exist_ok=True)
    with open(os.path.join(diagnostics_dir(run_dir), dump_stem(rank) + ".json"), "w", encoding="utf-8") as handle:
        json.dump(dump, handle)


def report(run_dir, capsys, *extra):
    assert diagnose_hang.main([str(run_dir), *extra]) == 0
    return capsys.readouterr().out


BEFORE = [record(0, "world", 6, "all_reduce", 4, "boundary"), record(1, "world", 7, "all_reduce", 4, "checkpoint")]
STUCK_STACK = """Thread 0x00007f0000000002 (most recent call first):
  File "/x/operations/watchdog.py", line 10 in _watch

Thread 0x00007f0000000001 (most recent call first):
  File "/repo/data/loader.py", line 77 in __next__
  File "/repo/training/train_step.py", line 12 in take_microbatches
"""


def test_a_rank_stuck_outside_any_collective_is_named_with_the_call_it_did_not_reach(tmp_path, capsys):
    for rank in (0, 1, 3):
        write(
            tmp_path,
            rank,
            BEFORE
            + [
                record(
                    2,
                    "world",
                    8,
                    "all_reduce",
                    5,
                    "boundary",
                    "failed",
                    error="[x.cc:1] Timed out waiting 20000ms. More",
                )
            ],
        )
    write(tmp_path, 2, BEFORE, cause="watchdog", stacks=STUCK_STACK)
    out = report(tmp_path, capsys)
    assert out.splitlines()[1] == (
        "rank 2 (tp 0, cp 0, dp 0, pp 1) did not reach all_reduce #8 (24 B, iteration 5, boundary) on world "
        "[0, 1, 2, 3], which ranks 0, 1, 3 entered: it is stuck outside any collective (watchdog: its last call "
        "all_reduce #7 on world (24 B, iteration 4, checkpoint) completed; main thread at data/loader.py:77 in "
        "__next__ < training/train_step.py:12 in take_microbatches)"
    )
    assert "  rank 0 (tp 0, cp 0, dp 0, pp 0): in all_reduce #8 on world (24 B, iteration 5, boundary): " in out
    assert "[x.cc:1] Timed out waiting 20000ms\n" in out  # the first sentence of torch's error


def test_a_rank_that_went_past_a_collective_is_where_the_ranks_part(tmp_path, capsys):
    for rank in (0, 1, 3):
        write(tmp_path, rank, BEFORE + [record(2, "world", 8, "all_reduce", 5, "boundary", "failed")])
    recv = record(2, "pp", 3, "recv", 5, "train", "failed", nbytes=4096, peer=0)
    write(tmp_path, 2, BEFORE + [recv])
    lines = report(tmp_path, capsys).splitlines()
    assert lines[1] == (
        "the ranks part on world [0, 1, 2, 3] at #8: ranks 0, 1, 3 entered all_reduce #8 (24 B, iteration 5, "
        "boundary); rank 2 (tp 0, cp 0, dp 0, pp 1) went on without it (skipped it): it is now in recv #3 from "
        "rank 0 on pp (4096 B, iteration 5, train)"
    )
    assert lines[2].startswith(
        "rank 2 (tp 0, cp 0, dp 0, pp 1) waits in recv #3 from rank 0 on pp (4096 B, iteration 5, train); "
        "rank 0 (tp 0, cp 0, dp 0, pp 0) never posted its send #3: it is blocked in all_reduce #8 on world"
    )


def test_calls_that_differ_at_one_sequence_number_name_the_odd_rank(tmp_path, capsys):
    for rank in range(4):
        # rank 3 issued iteration 6's boundary all-reduce where the others issued iteration 5's
        iteration = 6 if rank == 3 else 5
        write(tmp_path, rank, BEFORE + [record(2, "world", 8, "all_reduce", iteration, "boundary", "failed")])
    out = report(tmp_path, capsys)
    assert (
        "the ranks part on world [0, 1, 2, 3] at #8: ranks 0, 1, 2 issued all_reduce #8 (24 B, iteration 5, "
        "boundary); rank 3 (tp 1, cp 0, dp 0, pp 1) issued all_reduce #8 (24 B, iteration 6, boundary)"
    ) in out


def test_a_missing_dump_is_named_and_the_waiting_ranks_too(tmp_path, capsys):
    for rank in (0, 1, 3):
        write(tmp_path, rank, BEFORE + [record(2, "world", 8, "all_reduce", 5, "boundary", "failed")])
    out = report(tmp_path, capsys)
    assert "no dump from rank(s) 2: killed or crashed before writing one (see the log)" in out
    assert "ranks 0, 1, 3 wait on world for rank(s) without a dump: 2" in out


def test_stacks_of_one_rank_and_bad_input_in_one_line(tmp_path, capsys):
    write(tmp_path, 0, BEFORE, stacks=STUCK_STACK)
    assert report(tmp_path, capsys, "--stacks", "0") == STUCK_STACK
    assert diagnose_hang.main([str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nothing'}: no such folder"
    (tmp_path / "diagnostics" / "rank_00001.json").write_text("[1, 2]")
    assert diagnose_hang.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "rank_00001.json: not a dump of format 1" in err and "\n" not in err


def test_dumps_of_two_attempts_in_one_folder_are_said_to_be(tmp_path, capsys):
    """Before: ranks 0, 1 of one attempt and 2, 3 of the next were read as one hang, one confident story."""
    failed = BEFORE + [record(2, "world", 8, "all_reduce", 5, "boundary", "failed")]
    for rank in (0, 1):
        write(tmp_path, rank, failed, run="host-a:100", run_started=1000.0)
    for rank in (2, 3):
        write(tmp_path, rank, failed, run="host-a:200", run_started=2000.0)
    lines = report(tmp_path, capsys).splitlines()
    assert lines[0].startswith(
        f"warning: {tmp_path / 'diagnostics'} mixes the dumps of 2 attempts: analysing rank(s) 2, 3"
    )
    assert "host-a:200" in lines[0] and "left out: rank(s) 0, 1 of the attempt host-a:100" in lines[0]
    assert lines[1].startswith("2 of 4 ranks wrote a dump") and "no dump from rank(s) 0, 1" in lines[2]


def test_older_dumps_without_an_attempt_are_left_out_as_older(tmp_path, capsys):
    write(tmp_path, 0, BEFORE)
    write(tmp_path, 1, BEFORE, run="host-a:200", run_started=2000.0)
    first = report(tmp_path, capsys).splitlines()[0]
    assert "analysing rank(s) 1 of the attempt host-a:200" in first
    assert "left out: rank(s) 0 of an attempt that did not name itself" in first


def test_dumps_a_restart_moved_aside_are_read_and_said_to_be(tmp_path, capsys):
    """Before: after a resume the tool said "no rank_*.json dumps" without looking in diagnostics.1."""
    for rank in range(4):
        write(tmp_path, rank, BEFORE)
    moved = set_aside_previous(str(tmp_path))
    os.makedirs(diagnostics_dir(str(tmp_path)))  # the new attempt's folder, empty
    lines = report(tmp_path, capsys).splitlines()
    assert lines[0] == (
        f"{tmp_path / 'diagnostics'} holds no dumps: reading {moved}, the dumps of an earlier attempt (moved there "
        "when the run restarted)"
    )
    assert lines[1].startswith("4 of 4 ranks wrote a dump")


def test_a_malformed_dump_is_one_line_naming_the_file(tmp_path, capsys):
    """Before: a record whose seq was a string gave Python's raw TypeError text."""
    write(tmp_path, 0, BEFORE)
    write(tmp_path, 1, BEFORE[:1] + [{**BEFORE[1], "seq": "7"}])
    assert diagnose_hang.main([str(tmp_path)]) == 2
    bad = tmp_path / "diagnostics" / "rank_00001.json"
    assert capsys.readouterr().err == f'error: {bad}: not a readable dump (records[1].seq is "7", not int)\n'
    write(tmp_path, 1, [{k: v for k, v in BEFORE[0].items() if k != "group"}])
    assert diagnose_hang.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {bad}: not a readable dump (records[0].group is missing)\n"
