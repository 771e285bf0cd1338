"""PTDP_INJECT_FAULT: parsed and checked in one line; the injector leaves out one call, stalls, or slows down."""

import time

import pytest

import pretrain_gpt
from parallel.comm import CommRecorder
from training.faults import FaultInjector, FaultSpec, fault_from_env, parse_fault

pytestmark = pytest.mark.tier("fast")


def test_a_well_formed_value_and_the_unset_one():
    assert parse_fault("rank=2,iteration=5,kind=sleep", 4) == FaultSpec(2, 5, "sleep")
    assert parse_fault(" kind=slow , rank=0, iteration=1 ", 1) == FaultSpec(0, 1, "slow")
    assert fault_from_env(4, {}) is None and fault_from_env(4, {"PTDP_INJECT_FAULT": " "}) is None
    assert fault_from_env(4, {"PTDP_INJECT_FAULT": "rank=3,iteration=2,kind=skip"}) == FaultSpec(3, 2, "skip")
    assert FaultSpec(2, 5, "sleep").describe() == (
        "PTDP_INJECT_FAULT=rank=2,iteration=5,kind=sleep: test hook active: rank 2 stalls before its first "
        "collective of iteration 5"
    )


@pytest.mark.parametrize(
    "value, expected",
    [
        ("rank=2,iteration=5", "kind is missing; expected rank=R,iteration=N,kind=sleep|skip|slow"),
        ("rank=2,iteration=5,kind=nap", "kind=nap is not one of sleep, skip, slow"),
        ("rank=-1,iteration=5,kind=skip", "rank=-1 is not a non-negative integer"),
        ("rank=4,iteration=5,kind=skip", "rank=4 is outside this run's 4 rank(s)"),
        ("rank=1,iteration=0,kind=skip", "iteration=0 must be >= 1"),
        ("rank=1,rank=2,iteration=1,kind=skip", "'rank=2' is not a field or is repeated"),
        ("rank 1", "'rank 1' is not a field or is repeated"),
    ],
)
def test_a_malformed_value_is_one_line_naming_it(value, expected):
    with pytest.raises(ValueError) as err:
        parse_fault(value, 4)
    message = str(err.value)
    assert message.startswith(f"PTDP_INJECT_FAULT={value!r}: ") and expected in message and "\n" not in message


class _Logger:
    def __init__(self):
        self.lines = []

    def warning(self, line):
        self.lines.append(line)


def test_skip_leaves_out_the_first_synchronous_collective_of_the_iteration_once():
    recorder, logger = CommRecorder(), _Logger()
    inject = FaultInjector(FaultSpec(1, 5, "skip"), recorder, logger)
    with recorder.during("boundary", 4):
        assert inject("all_reduce", "world", False)  # an earlier iteration
    with recorder.during("checkpoint", 5):
        assert inject("all_gather_object", "checkpoint", False)  # not the training loop's
    with recorder.during("boundary", 5):
        assert inject("p2p", "pp", True) and inject("all_reduce", "dp", True)  # transfers and async calls go
        assert not inject("all_reduce", "world", False)
        assert inject("all_reduce", "world", False)  # once only
    assert logger.lines == ["PTDP_INJECT_FAULT: rank 1 leaves out all_reduce on world at iteration 5"]


def test_sleep_stalls_before_the_collective_until_stopped(monkeypatch):
    recorder, logger = CommRecorder(), _Logger()
    naps = []

    def nap(seconds):
        naps.append(seconds)
        if len(naps) == 3:
            raise InterruptedError  # what the watchdog's exit is to the real sleep

    monkeypatch.setattr(time, "sleep", nap)
    inject = FaultInjector(FaultSpec(0, 2, "sleep"), recorder, logger)
    with recorder.during("boundary", 2), pytest.raises(InterruptedError):
        inject("all_reduce", "world", False)
    assert naps == [3600, 3600, 3600] and "stalls before all_reduce on world at iteration 2" in logger.lines[0]


def test_slow_sleeps_as_long_as_the_rank_computed_since_its_last_call_returned(monkeypatch):
    recorder = CommRecorder()
    naps = []
    monkeypatch.setattr(time, "sleep", naps.append)
    inject = FaultInjector(FaultSpec(0, 3, "slow"), recorder, _Logger())
    with recorder.during("train", 2):
        assert inject("all_reduce", "tp", False) and naps == []  # before its iteration
    entry = recorder.record("tp", 2, "all_reduce", 8)
    recorder.finish(entry, time.perf_counter())
    returned = recorder.last_return
    with recorder.during("train", 3):
        before = time.perf_counter()
        assert inject("p2p", "pp", True)
        after = time.perf_counter()
    assert len(naps) == 1 and before - returned <= naps[0] <= after - returned


def test_the_trainer_refuses_a_malformed_value_in_one_line_before_any_work(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PTDP_INJECT_FAULT", "rank=1,iteration=3,kind=slow")  # one process: no rank 1
    assert pretrain_gpt.main([f"run.dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err == (
        "error: PTDP_INJECT_FAULT='rank=1,iteration=3,kind=slow': rank=1 is outside this run's 1 rank(s)\n"
    )
    assert not (tmp_path / "run").exists()
