"""PTDP_INJECT_FAULT: parsed and checked in one line; the injector leaves out one call, stalls, or slows down."""

import logging
import time

import pytest

import pretrain_gpt
from operations.faults import FaultInjector, FaultSpec, InjectedFault, fault_from_env, parse_fault
from parallel.comm_recorder import CommRecorder

pytestmark = pytest.mark.tier("fast")


def test_a_well_formed_value_and_the_unset_one():
    assert parse_fault("rank=2,iteration=5,kind=sleep", 4, 10) == FaultSpec(2, 5, "sleep")
    assert parse_fault(" kind=slow , rank=0, iteration=1 ", 2, 10) == FaultSpec(0, 1, "slow")
    assert parse_fault("rank=0,iteration=10,kind=raise", 1, 10) == FaultSpec(0, 10, "raise")  # one process too
    assert fault_from_env(4, 10, {}) is None and fault_from_env(4, 10, {"PTDP_INJECT_FAULT": " "}) is None
    assert fault_from_env(4, 10, {"PTDP_INJECT_FAULT": "rank=3,iteration=2,kind=skip"}) == FaultSpec(3, 2, "skip")
    assert FaultSpec(2, 5, "sleep").describe() == (
        "PTDP_INJECT_FAULT=rank=2,iteration=5,kind=sleep: test hook active: rank 2 stalls before its first "
        "collective of iteration 5"
    )


@pytest.mark.parametrize(
    "value, expected",
    [
        ("rank=2,iteration=5", "kind is missing; expected rank=R,iteration=N,kind=sleep|skip|slow|raise"),
        ("rank=2,iteration=5,kind=nap", "kind=nap is not one of sleep, skip, slow, raise"),
        ("rank=-1,iteration=5,kind=skip", "rank=-1 is not a non-negative integer"),
        ("rank=4,iteration=5,kind=skip", "rank=4 is outside this run's 4 rank(s)"),
        ("rank=1,iteration=0,kind=skip", "iteration=0 must be >= 1"),
        ("rank=1,rank=2,iteration=1,kind=skip", "'rank=2' is not a field or is repeated"),
        ("rank 1", "'rank 1' is not a field or is repeated"),
        # a digit int() does not read: one line of ours, not int()'s "invalid literal"
        ("rank=\u00b2,iteration=5,kind=skip", "rank=\u00b2 is not a non-negative integer"),
        ("rank=1,iteration=\u0665,kind=skip", "iteration=\u0665 is not a non-negative integer"),
        # past the run: the bound and why
        ("rank=1,iteration=11,kind=raise", "iteration=11 is after this run's last iteration (train.train_iters=10)"),
        ("rank=1,iteration=1234567890123,kind=skip", "iteration=1234567890123 is after this run's last iteration"),
        ("rank=12345678901234567890,iteration=5,kind=skip", "rank=12345678901234567890 is outside this run's 4"),
    ],
)
def test_a_malformed_value_is_one_line_naming_it(value, expected):
    with pytest.raises(ValueError) as err:
        parse_fault(value, 4, 10)
    message = str(err.value)
    assert message.startswith(f"PTDP_INJECT_FAULT={value!r}: ") and expected in message and "\n" not in message


@pytest.mark.parametrize("kind", ["sleep", "skip", "slow"])
def test_a_collective_fault_in_a_one_process_run_is_refused_saying_why(kind):
    with pytest.raises(ValueError) as err:
        parse_fault(f"rank=0,iteration=2,kind={kind}", 1, 10)
    assert str(err.value) == (
        f"PTDP_INJECT_FAULT='rank=0,iteration=2,kind={kind}': kind={kind} acts on the rank's collectives and a "
        f"one-process run has none, so it would never fire: run 2 or more ranks (kind=raise fires in one process too)"
    )


def test_raise_fires_on_its_rank_at_its_iteration_only():
    spec = FaultSpec(1, 3, "raise")
    for rank, iteration in [(0, 3), (1, 2), (1, 4)]:
        spec.raise_if_due(rank, iteration)
    FaultSpec(1, 3, "skip").raise_if_due(1, 3)  # the collective kinds act through the injector instead
    with pytest.raises(InjectedFault, match=r"^PTDP_INJECT_FAULT=rank=1,iteration=3,kind=raise: rank 1 raises at"):
        spec.raise_if_due(1, 3)
    with pytest.raises(ValueError, match="kind=raise does not act on collectives"):
        FaultInjector(spec, CommRecorder(), logging.getLogger(__name__))


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


@pytest.mark.parametrize(
    "value, message",
    [
        ("rank=1,iteration=3,kind=slow", "rank=1 is outside this run's 1 rank(s)"),  # one process: no rank 1
        ("rank=0,iteration=3,kind=sleep", "kind=sleep acts on the rank's collectives and a one-process run has none"),
    ],
)
def test_the_trainer_refuses_a_malformed_value_in_one_line_before_any_work(
    monkeypatch, tmp_path, capsys, value, message
):
    monkeypatch.setenv("PTDP_INJECT_FAULT", value)
    assert pretrain_gpt.main([f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: PTDP_INJECT_FAULT={value!r}: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
