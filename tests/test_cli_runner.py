"""run_cli (tests/cli_runner.py): a command line of this repository run in a fork gives what a new `python`
gives (exit code, stdout, stderr, input, cwd, environment, interpreter state), a timeout kills it and says
where it was, and commands it cannot fork run as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import cli_runner, rank_pool
from tests.cli_runner import CommandTimedOut, python_target, run_cli
from tests.conftest import REPO_ROOT

pytestmark = [
    pytest.mark.tier("fast"),
    pytest.mark.skipif(not rank_pool.pool_enabled(), reason="PTDP_RANK_POOL=0: no fork to test"),
]
CASES = os.path.join("tests", "cli_runner_cases.py")


@pytest.fixture
def no_new_processes(monkeypatch):
    """Any subprocess started by this process fails the test: run_cli must fork, not start a python."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"run_cli started a process: {args[1] if len(args) > 1 else kwargs}")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


def both(*args: str, **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """The forked run and a real `python` of tests/cli_runner_cases.py with these arguments."""
    argv = [sys.executable, CASES, *args]
    forked = run_cli(argv, cwd=REPO_ROOT, **kwargs)
    real = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, **kwargs)
    return forked, real


@pytest.mark.parametrize(
    "args,returncode",
    [
        (("exit", "0"), 0),
        (("exit", "2"), 2),
        (("exit", "-1"), 255),
        (("exit", "256"), 0),
        (("exit-none",), 0),
        (("exit-message", "no such file x.bin"), 1),
        (("streams",), 3),
        (("raise", "x"), 1),
        (("interrupt",), -2),
        (("signal",), -15),
        (("at-exit",), 0),
        (("basic-config",), 0),
        (("state",), 0),
    ],
)
def test_a_forked_command_gives_what_python_gives(args, returncode):
    forked, real = both(*args)
    if args == ("state",) and forked.returncode == real.returncode == 0:
        assert json.loads(forked.stdout) == json.loads(real.stdout)  # a failure names the fields that differ
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
    assert forked.returncode == returncode


def test_a_signal_the_suite_ignores_stays_ignored_as_in_python():
    """Started in the background from a script, the suite ignores SIGINT, and so does every python it starts."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forked, real = both("state")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert json.loads(real.stdout)["signals"]["SIGINT"] == str(int(signal.SIG_IGN))
    assert json.loads(forked.stdout) == json.loads(real.stdout)


def test_exit_codes_and_streams_as_python_reports_them(no_new_processes):
    message = run_cli([sys.executable, CASES, "exit-message", "no such file x.bin"], cwd=REPO_ROOT)
    assert (message.returncode, message.stdout, message.stderr) == (1, "", "error: no such file x.bin\n")
    streams = run_cli([sys.executable, CASES, "streams"], cwd=REPO_ROOT)
    assert streams.returncode == 3 and streams.stdout == "to stdout\n"
    assert streams.stderr == "to stderr\nfd 2 directly\n"
    crash = run_cli([sys.executable, CASES, "raise", "x"], cwd=REPO_ROOT)
    lines = crash.stderr.splitlines()
    assert crash.returncode == 1 and lines[0] == "Traceback (most recent call last):"
    assert (
        lines[-1] == "ValueError: bad value 'x'" and "runpy" not in crash.stderr and "cli_runner.py" not in crash.stderr
    )
    assert run_cli([sys.executable, CASES, "signal"], cwd=REPO_ROOT).returncode == -15
    at_exit = run_cli([sys.executable, CASES, "at-exit"], cwd=REPO_ROOT)
    assert at_exit.stdout == "thread joined\natexit ran\n"  # non-daemon threads joined, then atexit, as python


def test_input_cwd_and_environment_are_the_commands(tmp_path, no_new_processes):
    echoed = run_cli([sys.executable, CASES, "echo"], cwd=REPO_ROOT, input="abc\ndef\n")
    assert echoed.returncode == 0 and echoed.stdout == "ABC\nDEF\n"
    assert run_cli([sys.executable, CASES, "echo"], cwd=REPO_ROOT).stdout == ""  # no input: /dev/null
    env = {**os.environ, "PTDP_CLI_CASE": "seven"}
    where = run_cli([sys.executable, os.path.join(REPO_ROOT, CASES), "where", "PTDP_CLI_CASE"], cwd=tmp_path, env=env)
    seen = json.loads(where.stdout)
    assert seen["cwd"] == str(tmp_path) and seen["value"] == "seven" and seen["parent"] != os.getpid()
    assert "PTDP_CLI_CASE" not in os.environ and os.getcwd() != str(tmp_path)  # nothing came back to pytest
    raw = run_cli([sys.executable, CASES, "echo"], cwd=REPO_ROOT, input=b"abc\r\n", text=False)
    assert raw.stdout == b"ABC\r\n"  # bytes in, bytes out (python's sys.stdin: newline "\\n", no translation)


def test_module_form_runs_as_main(no_new_processes):
    result = run_cli([sys.executable, "-m", "tests.cli_runner_cases", "exit-message", "as a module"], cwd=REPO_ROOT)
    assert (result.returncode, result.stderr) == (1, "error: as a module\n")


def test_a_command_past_its_timeout_is_killed_with_its_stack_and_the_next_one_runs():
    began = time.monotonic()
    with pytest.raises(CommandTimedOut) as caught:
        run_cli([sys.executable, CASES, "sleep", "600"], cwd=REPO_ROOT, timeout=1.0)
    assert time.monotonic() - began < 30
    assert isinstance(caught.value, subprocess.TimeoutExpired) and caught.value.output == "sleeping\n"
    assert "cli_runner_cases.py" in str(caught.value) and "in main" in str(caught.value)
    assert run_cli([sys.executable, CASES, "exit", "4"], cwd=REPO_ROOT).returncode == 4  # a new worker


def test_what_cannot_be_forked_runs_as_a_real_process(tmp_path):
    assert python_target([sys.executable, "-c", "pass"], REPO_ROOT) is None
    assert python_target([sys.executable, "-m", "torch.distributed.run", "x.py"], REPO_ROOT) is None
    assert python_target([sys.executable, "-X", "importtime", CASES], REPO_ROOT) is None
    assert python_target(["bash", "scripts/gpu_check.sh"], REPO_ROOT) is None
    outside = tmp_path / "outside.py"
    outside.write_text("print('outside')\n")
    assert python_target([sys.executable, str(outside)], REPO_ROOT) is None
    assert python_target([sys.executable, CASES, "exit", "1"], REPO_ROOT) == (
        "script",
        os.path.join(REPO_ROOT, CASES),
        ["exit", "1"],
    )
    assert run_cli([sys.executable, str(outside)]).stdout == "outside\n"
    # a variable read at interpreter start (here OpenMP's) needs a new interpreter: a real child of pytest
    env = {**os.environ, "OMP_NUM_THREADS": "3", "PTDP_CLI_CASE": "x"}
    assert cli_runner.changes_start_up(env) and not cli_runner.changes_start_up({**os.environ, "PTDP_CLI_CASE": "x"})
    where = run_cli([sys.executable, CASES, "where", "OMP_NUM_THREADS"], cwd=REPO_ROOT, env=env)
    assert json.loads(where.stdout)["parent"] == os.getpid()
