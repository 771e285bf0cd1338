"""Persistent gloo ranks for the tests: `run_ranks` (tests/conftest.py) runs test bodies on rank workers that
stay up for the session.

One set of rank workers per world size (at most MAX_RANKS processes at a time, the least recently used set
retired first). A worker runs each body in a fork of itself: the fork costs milliseconds (the worker already
holds torch, the trainer and every test module), and whatever the body changes in its process (environment,
cwd, signal handlers, thread count, RNG, default dtype, monkeypatched modules, registered ops, threads it
started) ends with it, so no test can leave state for the next. Each body gets a fresh default process group
(a new port and TCPStore). A body that fails or hangs past its timeout: the parent reports the test, each
failing rank and its traceback (a hung rank: the stack faulthandler dumped at the timeout) as an
AssertionError, the first failure first and each distinct text once under its ranks (32 ranks' copies of one
stack read as one), kills that set of workers with their bodies, and the next call starts a new set.

Fork safety: the workers are forked from a zygote, which pytest forks right after collection (every test
module imported, `warm_up` done, no test run yet: no OpenMP thread pool, no gloo), and which only ever forks.
Bodies travel by pickle (a function by its module and qualified name), so a local function or an unpicklable
argument (a queue, a lock) falls back to forking from pytest, as does PTDP_RANK_POOL=0 (to rule the pool out
when debugging).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import resource
import secrets
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener, Pipe, wait

# rank workers kept at once: sets for 1, 2, 4 and 8 ranks (idle, their memory shared with the zygote); a larger
# world size gets a set of its own for its run, retired with it
MAX_RANKS = 16
START_TIMEOUT_S = 60.0
ERROR_GRACE_S = 2.0  # after one rank fails, how long the others get to report theirs before all are killed
POOL_SWITCH = "PTDP_RANK_POOL"


def pool_enabled() -> bool:
    """PTDP_RANK_POOL=0 turns the pool off (every run_ranks forks fresh processes, as before the pool)."""
    return os.environ.get(POOL_SWITCH, "1") != "0"


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class _OutputTo:
    """Send fds 1 and 2 (print, C++ warnings, gloo's messages) to a file for the body's duration."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self.handle = open(self.path, "wb", buffering=0)
        self.saved = (os.dup(1), os.dup(2))
        os.dup2(self.handle.fileno(), 1)
        os.dup2(self.handle.fileno(), 2)
        return self.handle

    def __exit__(self, *exc) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self.saved, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
        self.handle.close()


def join_ranks(rank: int, world_size: int, port: int) -> None:
    """Make this process rank `rank` of a fresh gloo default group on `port`, with one thread.

    One thread per rank, also for a single rank: the trainer sizes its thread pool from LOCAL_WORLD_SIZE (set
    so that it gives one), and a forked child that opens an OpenMP region after its parent used libgomp's pool
    can hang in its first parallel op (libgomp is not fork-safe); one thread never opens a region.
    """
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(max(world_size, os.cpu_count() or 1)),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def set_parent_death_signal() -> None:
    """SIGKILL this process when its parent dies (Linux prctl), so that no rank outlives pytest."""
    import ctypes

    # not Linux (no prctl): the workers still end when their connection closes
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG


def _run_body(rank: int, world_size: int, request: tuple) -> str | None:
    """In the body's fork: run it on this rank with a fresh default process group; its traceback or None."""
    import torch.distributed as dist

    payload, port, output_path, timeout = request
    with _OutputTo(output_path) as output:
        faulthandler.dump_traceback_later(timeout, file=output)  # a hung rank's stack, for the report
        try:
            fn, args = pickle.loads(payload)
            join_ranks(rank, world_size, port)
            fn(rank, world_size, *args)
            if dist.is_initialized():  # fn may have torn the group down itself (pretrain_gpt.main does)
                dist.barrier()
                dist.destroy_process_group()
            return None
        except BaseException:  # report every failure, assertion or not, SystemExit included
            return traceback.format_exc()
        finally:
            faulthandler.cancel_dump_traceback_later()


def _exit_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.WEXITSTATUS(status)}"


def _fork_body(rank: int, world_size: int, request: tuple) -> tuple[str | None, float]:
    """Run one body in a fork of this worker: (its traceback or None, the CPU seconds it used)."""
    reader, writer = Pipe(duplex=False)
    began = children_cpu_seconds()
    pid = os.fork()
    if pid == 0:
        reader.close()
        set_parent_death_signal()
        try:
            writer.send(_run_body(rank, world_size, request))
        finally:
            os._exit(0)
    writer.close()
    try:
        error = reader.recv()
    except EOFError:  # it ended before reporting: os._exit in the body, or a signal
        error = "the rank's process ended without reporting"
    reader.close()
    _, status = os.waitpid(pid, 0)
    if error is not None and status != 0:
        error = f"{error} ({_exit_status(status)})"
    return error, children_cpu_seconds() - began


def _worker_main(rank: int, world_size: int, address: str, authkey: bytes, sigint_handler, serve: Callable) -> None:
    """A worker: answer each request the parent sends with `serve(rank, world_size, request)` (a rank's
    `_fork_body`, or tests/cli_runner.py's command line), until the parent hangs up. Each body's fork sets its
    own thread count (join_ranks: one), so the worker leaves torch's as pytest started it."""
    os.setpgid(0, 0)  # its own process group: the parent kills a worker with its body and their children
    set_parent_death_signal()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the zygote ignores it; the worker waits for its bodies
    signal.signal(signal.SIGINT, sigint_handler)  # what pytest had, as a rank forked from it inherited
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    conn.send((rank, os.getpid()))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(serve(rank, world_size, request))


def warm_up() -> None:
    """Pay, once before the zygote is forked, what every rank body would otherwise pay again in its fresh fork.

    - torch._dynamo and Triton (~1.4 CPU s), which the bodies that compile or run the fused kernels import (a
      plain training run does not: tests/test_start_up_imports.py).
    - Then every object alive is moved out of the garbage collector's reach (`gc.freeze`, meant for exactly
      this: processes forked from a warmed parent): otherwise the first full collection in each body walks the
      ~600,000 objects of torch, dynamo and the test modules (~0.2-0.3 CPU s) and, by touching each object's
      header, copies the pages the fork shared with the zygote.
    Imports only: no arithmetic, no thread (tests/test_rank_pool.py checks). pytest runs it before forking the
    zygote (tests/conftest.py), so the two stay alike: inductor's import sets TORCHINDUCTOR_CACHE_DIR, and
    tests/cli_runner.py compares a command's environment with the zygote's.
    """
    import gc

    import torch._dynamo  # noqa: F401 - imported for the forks, not used here

    gc.collect()
    gc.freeze()


def _zygote_main(conn: Connection) -> None:
    """Fork workers on request; the zygote itself runs no test body and starts no thread."""
    set_parent_death_signal()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel as they exit
    sigint_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the zygote ends when its pipe closes
    while True:
        try:
            world_size, address, authkey, serve = conn.recv()  # serve: a module-level function, by name
        except (EOFError, OSError):
            return
        for rank in range(world_size):
            try:
                pid = os.fork()
            except OSError:  # EAGAIN: the parent's accept times out and says so
                break
            if pid == 0:
                conn.close()
                code = 0
                try:
                    _worker_main(rank, world_size, address, authkey, sigint_handler, serve)
                except BaseException:
                    traceback.print_exc()
                    code = 1
                os._exit(code)


class Zygote:
    """The clean process rank workers are forked from (forked itself at session start)."""

    def __init__(self) -> None:
        parent_end, child_end = Pipe()
        pid = os.fork()
        if pid == 0:
            parent_end.close()
            try:
                _zygote_main(child_end)
            finally:
                os._exit(0)
        child_end.close()
        self.pid, self.conn = pid, parent_end

    def fork_workers(self, world_size: int, address: str, authkey: bytes, serve: Callable) -> None:
        self.conn.send((world_size, address, authkey, serve))

    def close(self) -> None:
        self.conn.close()
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


class RankWorkers:
    """`world_size` connected worker processes that answer requests with `serve` (default: run a rank's body)."""

    def __init__(self, zygote: Zygote, world_size: int, serve: Callable = _fork_body):
        self.world_size = world_size
        self.folder = tempfile.mkdtemp(prefix=f"ptdp-ranks{world_size}-")
        address, authkey = os.path.join(self.folder, "socket"), secrets.token_bytes(16)
        self.conns: list[Connection] = [None] * world_size  # type: ignore[list-item]
        self.pids: list[int] = [0] * world_size
        with Listener(address, family="AF_UNIX", authkey=authkey) as listener:
            zygote.fork_workers(world_size, address, authkey, serve)
            listener._listener._socket.settimeout(START_TIMEOUT_S)  # type: ignore[attr-defined]
            try:
                for _ in range(world_size):
                    conn = listener.accept()
                    rank, pid = conn.recv()
                    self.conns[rank], self.pids[rank] = conn, pid
            except OSError as err:  # socket.timeout: the zygote could not fork (out of processes?)
                self.close()
                raise AssertionError(f"{world_size} rank workers did not start within {START_TIMEOUT_S} s") from err

    def run(self, payload: bytes, timeout: float, free_port: Callable[[], int]) -> tuple[str | None, float, bool]:
        """Run one body on every rank: (the failure report or None, the ranks' CPU seconds, all went well)."""
        outputs = [os.path.join(self.folder, f"rank{rank}.out") for rank in range(self.world_size)]
        port = free_port()
        for rank, conn in enumerate(self.conns):
            conn.send((payload, port, outputs[rank], timeout))
        results: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout + 3.0  # the ranks' faulthandler dumps at `timeout`
        pending = dict(enumerate(self.conns))
        while pending and time.monotonic() < deadline:
            for conn in wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic())):
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    results[rank] = conn.recv()
                except (EOFError, OSError):
                    results[rank] = ("the rank's worker ended without a reply", 0.0)
                del pending[rank]
                if results[rank][0] is not None:  # one rank failed: the others may wait in a collective
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        _replay(outputs)
        cpu = sum(result[1] for result in results.values())
        # in the order they came: the first to fail is the likeliest cause, the others mostly report the
        # collective it broke
        failures = [(rank, error) for rank, (error, _) in results.items() if error]
        if pending and not failures:
            stacks = _grouped_reports([(rank, _tail(outputs[rank])) for rank in pending], " (stack at the timeout)")
            return f"{_rank_list(sorted(pending))} did not finish within {timeout} s\n{stacks}", cpu, False
        return (_grouped_reports(failures) or None), cpu, not failures

    def close(self) -> None:
        for conn in self.conns:
            if conn is not None:
                conn.close()
        for pid in self.pids:  # each worker leads a process group: it, its body, the body's children
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        shutil.rmtree(self.folder, ignore_errors=True)


def _grouped_reports(reports: list[tuple[int, str]], note: str = "") -> str:
    """Each distinct report once, under the ranks that sent it (`--- rank 1 ---`, `--- ranks 0, 2-31 ---`), in
    the order of their first rank in `reports`: 32 hung ranks give one stack, not 32 copies of it."""
    ranks_of: dict[str, list[int]] = {}
    for rank, text in reports:
        ranks_of.setdefault(text, []).append(rank)
    return "\n".join(f"--- {_rank_list(ranks)}{note} ---\n{text}" for text, ranks in ranks_of.items())


def _rank_list(ranks: list[int]) -> str:
    """`rank 3`, or `ranks 0, 2-31` (runs of consecutive ranks as ranges)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return "ranks " + ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def _replay(outputs: list[str]) -> None:
    """What the ranks printed, to this process's fds 1 (pytest captures it and shows it with a failure)."""
    for path in outputs:
        if os.path.exists(path):
            with open(path, "rb") as handle:
                data = handle.read()
            if data:
                os.write(1, data)


def _tail(path: str, limit: int = 6000) -> str:
    if not os.path.exists(path):
        return "(no output)"
    with open(path, "rb") as handle:
        return handle.read()[-limit:].decode(errors="replace")


class RankPool:
    """This process's sets of rank workers, one per world size, restarted after a failure."""

    def __init__(self, zygote: Zygote):
        self.zygote = zygote
        self.workers: OrderedDict[int, RankWorkers] = OrderedDict()  # least recently used first
        self.helpers: dict[Callable, RankWorkers] = {}  # one worker per kind of request (tests/cli_runner.py)
        self.report_cpu: Callable[[float], None] | None = None  # the cost recorder's hook (tests/cpu_costs.py)

    def run(self, world_size: int, payload: bytes, timeout: float, free_port: Callable[[], int]) -> None:
        """Run `payload` (pickled (fn, args)) on `world_size` ranks; raise AssertionError with each failing
        rank's traceback."""
        workers = self._workers(world_size)
        failure, cpu, reusable = workers.run(payload, timeout, free_port)
        if self.report_cpu is not None:
            self.report_cpu(cpu)
        if not reusable or world_size > MAX_RANKS:
            # a set larger than the cap (32 ranks: tests/e2e/test_scale.py) runs, but is not kept idle after
            self.retire(world_size)
        if failure is not None:
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
            raise AssertionError(f"{test} failed on the rank pool ({world_size} ranks):\n{failure}")

    def _workers(self, world_size: int) -> RankWorkers:
        if world_size in self.workers:
            self.workers.move_to_end(world_size)
            return self.workers[world_size]
        while self.workers and sum(self.workers) + world_size > MAX_RANKS:
            self.retire(next(iter(self.workers)))
        self.workers[world_size] = RankWorkers(self.zygote, world_size)
        return self.workers[world_size]

    def retire(self, world_size: int) -> None:
        workers = self.workers.pop(world_size, None)
        if workers is not None:
            workers.close()

    def helper(self, serve: Callable) -> RankWorkers:
        """The one worker that answers requests with `serve` (a module-level function), started at first use
        and again after `retire_helper`."""
        if serve not in self.helpers:
            self.helpers[serve] = RankWorkers(self.zygote, 1, serve)
        return self.helpers[serve]

    def retire_helper(self, serve: Callable) -> None:
        """Kill `serve`'s worker with whatever it runs (a command past its timeout)."""
        helper = self.helpers.pop(serve, None)
        if helper is not None:
            helper.close()

    def close(self) -> None:
        for world_size in list(self.workers):
            self.retire(world_size)
        for serve in list(self.helpers):
            self.retire_helper(serve)
        self.zygote.close()


def picklable_body(fn, args: tuple) -> bytes | None:
    """(fn, args) pickled for the pool, or None where they cannot travel (a local function, a queue, a lock)."""
    if getattr(fn, "__module__", "__main__") == "__main__":
        return None
    try:
        return pickle.dumps((fn, args))
    except Exception:  # pickle raises PicklingError, TypeError, AttributeError... for what cannot travel
        return None
