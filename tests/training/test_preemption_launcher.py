"""A rank started by torchrun stops (as if sent SIGTERM) when its launcher dies: the kernel's parent-death
signal, or the parent check that the iteration boundary's read of `received` makes. A plain run (no torchrun)
does not watch its parent: `nohup python pretrain_gpt.py &` must survive the shell's exit."""

import os
import select
import signal
import time

import pytest

from operations.preemption import PreemptionHandler

pytestmark = pytest.mark.tier("fast")

UNDER_TORCHRUN = {"TORCHELASTIC_RUN_ID": "test"}


def _rank(write_fd: int) -> None:
    """The grandchild: a rank whose parent (the launcher) will die. Reports what it received, then exits."""
    with PreemptionHandler(UNDER_TORCHRUN) as handler:
        os.write(write_fd, b"ready\n")
        deadline = time.monotonic() + 30
        while handler._received is None and time.monotonic() < deadline:  # only the signal may set it here
            time.sleep(0.05)
        received = handler._received
    os.write(write_fd, f"{received.name if received else None}\n".encode())


def test_the_launchers_death_stops_the_rank(capfd):
    read_fd, write_fd = os.pipe()
    launcher = os.fork()
    if launcher == 0:  # the launcher: start the rank, wait until it is ready, then die
        try:
            if os.fork() == 0:
                try:
                    _rank(write_fd)
                finally:
                    os._exit(0)
            select.select([read_fd], [], [], 30)
            os.read(read_fd, 6)
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(launcher, 0)
    lines = b""
    while not lines.endswith(b"\n"):
        ready, _, _ = select.select([read_fd], [], [], 30)
        assert ready, "the rank did not report"
        chunk = os.read(read_fd, 100)
        assert chunk, "the rank exited without reporting"
        lines += chunk
    os.close(read_fd)
    assert lines.decode().split() == ["SIGTERM"]
    assert f"torchrun (pid {launcher}), which started this rank, is gone" in capfd.readouterr().err


def test_the_boundary_check_catches_a_launcher_already_gone():
    handler = PreemptionHandler(UNDER_TORCHRUN)
    assert handler.received is None
    handler._launcher = os.getppid() + 1_000_000  # a parent that is no longer ours: it died before prctl
    assert handler.received == signal.SIGTERM


def test_a_plain_run_does_not_watch_its_parent():
    handler = PreemptionHandler({})
    assert handler._launcher is None and handler.received is None
