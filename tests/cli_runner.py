"""`run_cli`: run one of this repository's command lines (`python tools/X.py ...`, `python -m package.module ...`)
as a test would with subprocess.run, in a fork of an already-imported process instead of a new interpreter.

A new python costs ~4.6 CPU s here (interpreter, `import torch`, the trainer); a fork costs milliseconds. The
fork comes from a worker of the rank pool's zygote (tests/rank_pool.py: forked by pytest right after
collection, so every module the tests import is there, and no test has run): one worker serves the command
lines, forking a child per command. The child becomes what `python script.py args` would be:

- sys.argv, sys.path[0] (the script's directory, or the working directory for -m), the working directory and
  the environment are the command's; fds 0, 1 and 2 are a file of `input` (else /dev/null), and the files
  whose contents come back as stdout and stderr; sys.std* are new text streams on them;
- signal handlers, warnings filters, logging's root handlers, excepthooks, atexit callbacks and the RNGs are
  put back to how a new interpreter starts (pytest changed some of them before the fork);
- the script runs with runpy as __main__; its exit code is taken as the interpreter takes it (SystemExit:
  None -> 0, an int -> that int, anything else printed to stderr -> 1; an uncaught exception: its traceback on
  stderr -> 1); then non-daemon threads are joined and atexit callbacks run, as at interpreter exit;
- with `timeout`, the stack at the timeout is dumped and the worker is killed with the child and anything it
  started; `CommandTimedOut` (a subprocess.TimeoutExpired) says so, with that stack.

What a fork cannot be is a new interpreter: modules the zygote imported are not imported again (their
import-time warnings do not repeat), and the interpreter's start-up settings are pytest's. So run_cli starts a
real process (subprocess.run) where the command is not a python script or module of this repository, where
the environment changes a variable read at interpreter start (PYTHON*, OMP_*, TRITON_*, TORCH*, LD_*, ...), or
where the pool is off (PTDP_RANK_POOL=0). Tests whose subject is the launch itself (an entry point's exit code
and signals, torchrun, SLURM, a thread count set at start-up, what a new interpreter imports) call
subprocess.run themselves (docs/testing.md, "Forked command lines").
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import io
import locale
import logging
import os
import random
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from multiprocessing.connection import wait

from tests import rank_pool

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# environment variables a new interpreter (or torch, Triton, the C libraries) reads when it starts: a command
# whose environment changes one of them needs a real process
START_UP_VARIABLES = ("PYTHON", "PYTORCH_", "TORCH_", "TRITON_", "OMP_", "GOMP_", "MKL_", "LD_", "MALLOC", "LC_")
START_UP_EXACT = ("LANG", "CUDA_VISIBLE_DEVICES")
# variables read when a library is imported: they matter where the fork already imported one of them (libraries
# also set some in-process, e.g. inductor's cache folder, which a command then inherits)
READ_AT_IMPORT = {
    "HF_": ("huggingface_hub", "datasets", "transformers"),
    "TORCHINDUCTOR_": ("torch._inductor",),
    "TORCHDYNAMO_": ("torch._dynamo",),
}
TORCH_DEFAULT_SEED = 67280421310721  # torch's CPU generator's seed in a new process (c10 default_rng_seed_val)
TIMEOUT_GRACE_S = 2.0  # after `timeout`, how long the child's stack dump gets before the kill


class CommandTimedOut(subprocess.TimeoutExpired):
    """subprocess.TimeoutExpired, with the forked command's stack at the timeout in its message."""

    def __init__(self, cmd, timeout: float, output, stderr, stack: str):
        super().__init__(cmd, timeout, output, stderr)
        self.stack = stack

    def __str__(self) -> str:
        return f"{super().__str__()} (run forked by tests/cli_runner.py); its stack then:\n{self.stack}"


def python_target(argv: list[str], cwd: str) -> tuple[str, str, list[str]] | None:
    """("script", path, args) or ("module", name, args) where argv runs a python file or module of this
    repository with no interpreter options; None otherwise."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if argv[1] == "-m" and len(argv) >= 3:
        relative = os.path.join(REPO_ROOT, *argv[2].split("."))
        found = os.path.isfile(relative + ".py") or os.path.isfile(os.path.join(relative, "__main__.py"))
        return ("module", argv[2], list(argv[3:])) if found else None
    script = os.path.realpath(os.path.join(cwd, argv[1]))
    if argv[1].startswith("-") or not script.endswith(".py") or not os.path.isfile(script):
        return None
    return ("script", script, list(argv[2:])) if script.startswith(REPO_ROOT + os.sep) else None


def changes_start_up(env: dict[str, str]) -> bool:
    """Whether `env` differs from this process's environment in a variable that this process read when it
    started or imported a library (a new interpreter would read the new value). PYTHONPATH may name more
    folders where this process's sys.path already holds them."""
    prefixes = START_UP_VARIABLES + tuple(
        prefix for prefix, modules in READ_AT_IMPORT.items() if any(module in sys.modules for module in modules)
    )
    names = {name for name in set(env) | set(os.environ) if name.startswith(prefixes) or name in START_UP_EXACT}
    if all(os.path.abspath(folder) in sys.path for folder in env.get("PYTHONPATH", "").split(os.pathsep) if folder):
        names.discard("PYTHONPATH")
    return any(env.get(name) != os.environ.get(name) for name in names)


def run_cli(
    argv: list[str],
    *,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    input: str | bytes | None = None,
    text: bool = True,
) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, cwd=..., env=..., timeout=..., input=..., capture_output=True, text=text)`, forked
    from the rank pool's zygote where argv is `sys.executable` running a script or module of this repository."""
    from tests.conftest import _SessionPool  # the pool pytest made after collection

    argv = [str(arg) for arg in argv]
    cwd = os.path.abspath(cwd or os.getcwd())
    env = dict(os.environ if env is None else env)
    target = python_target(argv, cwd)
    pool = _SessionPool.pool
    folder = tempfile.mkdtemp(prefix="ptdp-cli-")
    try:
        paths = {name: os.path.join(folder, name) for name in ("stdin", "stdout", "stderr", "stack")}
        if input is not None:
            with open(paths["stdin"], "wb") as handle:
                handle.write(input.encode() if isinstance(input, str) else input)
        else:
            paths["stdin"] = os.devnull
        returncode = None
        if pool is not None and target is not None:
            request = (target, env, cwd, paths, timeout, ignored_signals())
            returncode = _run_on_pool(pool, request, argv, text)
        if returncode is None:  # not a command of this repository, no pool, or it needs a new interpreter
            kwargs = {"input": input.encode() if isinstance(input, str) and not text else input}
            return subprocess.run(argv, cwd=cwd, env=env, timeout=timeout, capture_output=True, text=text, **kwargs)
        stdout, stderr = (_read(paths[name], text) for name in ("stdout", "stderr"))
        return subprocess.CompletedProcess(argv, returncode, stdout, stderr)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run_on_pool(pool: rank_pool.RankPool, request: tuple, argv: list[str], text: bool) -> int | None:
    """Send one command to the pool's command-line worker: its exit code (-N: killed by signal N), or None
    where the worker says it needs a new interpreter. Past its timeout, the worker is killed with it and
    CommandTimedOut raised."""
    paths, timeout = request[3], request[4]
    conn = pool.helper(serve_command).conns[0]
    conn.send(request)
    if not wait([conn], None if timeout is None else timeout + TIMEOUT_GRACE_S):
        pool.retire_helper(serve_command)
        stdout, stderr, stack = _read(paths["stdout"], text), _read(paths["stderr"], text), _read(paths["stack"], True)
        raise CommandTimedOut(argv, timeout, stdout, stderr, stack or "(none)")
    try:
        returncode, cpu = conn.recv()
    except (EOFError, OSError):
        pool.retire_helper(serve_command)
        raise AssertionError(f"the command-line worker ended without a reply running {argv}") from None
    if pool.report_cpu is not None:
        pool.report_cpu(cpu)
    return returncode


def _read(path: str, text: bool) -> str | bytes:
    if not os.path.exists(path):
        return "" if text else b""
    with open(path, "rb") as handle:
        data = handle.read()
    if not text:
        return data
    # as subprocess's text mode: the locale's encoding, universal newlines
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


def serve_command(rank: int, world_size: int, request: tuple) -> tuple[int | None, float]:
    """In the command-line worker: fork a child that runs the command, wait for it: (its exit code as
    subprocess reports it, the CPU seconds it used); (None, 0) where the command's environment changes what
    this process (the zygote's copy) read when it started."""
    if changes_start_up(request[1]):
        return None, 0.0
    began = rank_pool.children_cpu_seconds()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _run_command(*request)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), rank_pool.children_cpu_seconds() - began


def _run_command(
    target: tuple, env: dict, cwd: str, paths: dict, timeout: float | None, ignored: tuple[int, ...]
) -> int:
    """In the child: become `python <target>` and run it; its exit code."""
    inherited = (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__)  # noqa: F841 - kept alive: their buffers must never be flushed into the command's files
    _reset_signals(env, ignored)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _redirect_stdio(paths, env)
    if timeout is not None:
        stack = open(paths["stack"], "w")
        faulthandler.dump_traceback_later(timeout, file=stack)
    _reset_interpreter_state(env)
    kind, name, args = target
    code = _exit_code(_run_main, kind, name, args)
    return _finalize(code)


def ignored_signals() -> tuple[int, ...]:
    """The signals a new interpreter started from this process would find ignored: exec keeps SIG_IGN (a suite
    started in the background from a script ignores SIGINT), and subprocess puts SIGPIPE and SIGXFSZ, which
    python ignores itself, back to the default before the exec."""
    restored = (signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ)
    return tuple(
        int(number)
        for number in signal.valid_signals()
        if number not in restored and signal.getsignal(number) == signal.SIG_IGN
    )


def _reset_signals(env: dict, ignored: tuple[int, ...]) -> None:
    """Signal dispositions and mask as a new interpreter started from the test has them (pytest's and the
    zygote's handlers gone, the signals the test's process ignores still ignored)."""
    faulthandler.disable()  # pytest's faulthandler writes to pytest's stderr
    for number in signal.valid_signals():
        if number in (signal.SIGKILL, signal.SIGSTOP):
            continue
        if number in ignored:
            signal.signal(number, signal.SIG_IGN)
        elif signal.getsignal(number) not in (signal.SIG_DFL, None):
            signal.signal(number, signal.SIG_DFL)
    if signal.SIGINT not in ignored:  # python installs its handler only over the default
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # python ignores these two at start-up
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    rank_pool.set_parent_death_signal()  # the child ends with its worker (a timeout kills the worker)
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()


def _redirect_stdio(paths: dict, env: dict) -> None:
    """fds 0, 1, 2 to the command's files, and new sys.std* text streams on them made as python makes them at
    start-up (pylifecycle.c's create_stdio: newline "\\n", PYTHONUNBUFFERED, stderr's backslashreplace)."""
    for fd, path, flags in (
        (0, paths["stdin"], os.O_RDONLY),
        (1, paths["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, paths["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        handle = os.open(path, flags, 0o600)
        os.dup2(handle, fd)
        os.close(handle)
    buffered = not env.get("PYTHONUNBUFFERED")
    streams = []
    for fd, original in ((0, sys.__stdin__), (1, sys.__stdout__), (2, sys.__stderr__)):
        writes = fd != 0
        binary = open(fd, "wb" if writes else "rb", buffering=-1 if buffered or not writes else 0, closefd=False)
        streams.append(
            io.TextIOWrapper(
                binary,
                encoding=getattr(original, "encoding", None) or "utf-8",
                errors="backslashreplace" if fd == 2 else getattr(original, "errors", None) or "strict",
                newline="\n",
                line_buffering=buffered and fd == 2,
                write_through=not buffered,
            )
        )
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams


def _reset_interpreter_state(env: dict) -> None:
    """What pytest (or the zygote) changed in-process, put back as a new interpreter has it."""
    atexit._clear()  # pytest's and execnet's callbacks are not the command's
    sys.excepthook, sys.unraisablehook = sys.__excepthook__, sys.__unraisablehook__
    threading.excepthook = threading.__excepthook__
    warnings.filters[:] = [  # a new interpreter's filters (release build), then PYTHONWARNINGS
        ("default", None, DeprecationWarning, "__main__", 0),
        *(("ignore", None, category, None, 0) for category in (DeprecationWarning, PendingDeprecationWarning)),
        *(("ignore", None, category, None, 0) for category in (ImportWarning, ResourceWarning)),
    ]
    warnings._filters_mutated()  # type: ignore[attr-defined]
    # pytest's catch_warnings(record=True) was active at the fork: show warnings on stderr again
    warnings.showwarning, warnings.formatwarning = warnings._showwarning_orig, warnings._formatwarning_orig  # type: ignore[attr-defined]
    warnings._showwarnmsg_impl = _show_warning  # type: ignore[attr-defined]
    warnings._processoptions([option for option in env.get("PYTHONWARNINGS", "").split(",") if option])  # type: ignore[attr-defined]
    root = logging.getLogger()
    for handler in list(root.handlers):  # pytest's capture handlers: basicConfig would do nothing
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    logging.disable(logging.NOTSET)
    random.seed()  # seeded from the OS, as at import; a fork would share the zygote's state
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].default_generator.manual_seed(TORCH_DEFAULT_SEED)


def _show_warning(message: warnings.WarningMessage) -> None:
    """The warnings module's own _showwarnmsg_impl (pytest's recording replaced it before the fork)."""
    stream = message.file if message.file is not None else sys.stderr
    if stream is not None:
        with contextlib.suppress(OSError):
            stream.write(warnings._formatwarnmsg(message))  # type: ignore[attr-defined]


def _run_main(kind: str, name: str, args: list[str]) -> None:
    """runpy, as `python script.py args` or `python -m name args` runs the code (sys.path[0] included)."""
    if kind == "script":
        sys.argv = [name, *args]
        sys.path.insert(0, os.path.dirname(name))
        runpy.run_path(name, run_name="__main__")
    else:
        sys.argv = [name, *args]  # run_module puts the module's file in argv[0]
        sys.path.insert(0, os.getcwd())
        for module in (name, f"{name}.__main__"):  # a new interpreter has not imported it yet
            sys.modules.pop(module, None)
        runpy.run_module(name, run_name="__main__", alter_sys=True)


def _exit_code(run, *args) -> int:
    """Run the command's code; the exit code python would give it."""
    try:
        run(*args)
        return 0
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code & 0xFF
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # python ends by SIGINT after the traceback (its exit status says so)
        _print_uncaught(exc)
        _finalize(1)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException as exc:  # an uncaught exception: its traceback, exit code 1
        _print_uncaught(exc)
        return 1


def _print_uncaught(exc: BaseException) -> None:
    """The traceback python prints, from the script's frame on (not this module's or runpy's)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>"):
        tb = tb.tb_next
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)


def _finalize(code: int) -> int:
    """What the interpreter does at exit: join non-daemon threads, run atexit callbacks (the command's, then
    multiprocessing's and logging's, registered before the fork), flush sys.stdout and sys.stderr."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    if "multiprocessing.util" in sys.modules:
        sys.modules["multiprocessing.util"]._exit_function()
    logging.shutdown()
    faulthandler.cancel_dump_traceback_later()
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        code = code or 120  # python's exit code when it cannot flush stdout
    sys.stderr.flush()
    return code
