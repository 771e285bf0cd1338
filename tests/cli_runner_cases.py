"""A script for tests/test_cli_runner.py: each mode does one thing an interpreter must get right (exit codes,
streams, threads, atexit, signals), so that run_cli's fork and a real `python` can be compared.

python tests/cli_runner_cases.py MODE [ARG ...]
"""

import atexit
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings


def state() -> dict:
    """What a new interpreter starts with, that pytest or the zygote had changed."""
    dispositions = {
        name: str(signal.getsignal(getattr(signal, name))) for name in ("SIGINT", "SIGTERM", "SIGCHLD", "SIGPIPE")
    }
    filters = [(action, category.__name__, str(module)) for action, _, category, module, _ in warnings.filters]
    root = logging.getLogger()
    return {
        "argv0": os.path.basename(sys.argv[0]),
        "path0": sys.path[0],
        "file": __file__,
        "cwd": os.getcwd(),
        "signals": dispositions,
        "filters": filters,
        "root_logger": [len(root.handlers), root.level],
        "hooks": [sys.excepthook is sys.__excepthook__, threading.excepthook is threading.__excepthook__],
        "stdio": [
            [stream.isatty(), stream.line_buffering, stream.write_through, stream.encoding, stream.errors]
            for stream in (sys.stdin, sys.stdout, sys.stderr)
        ],
        "threads": threading.active_count(),
    }


def main(mode: str, *args: str) -> int | None:
    if mode == "exit":
        return int(args[0])
    if mode == "exit-none":
        sys.exit()
    if mode == "exit-message":
        sys.exit(f"error: {args[0]}")
    if mode == "streams":
        print("to stdout")
        print("to stderr", file=sys.stderr)
        os.write(2, b"fd 2 directly\n")
        return 3
    if mode == "raise":
        raise ValueError(f"bad value {args[0]!r}")
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "signal":
        os.kill(os.getpid(), signal.SIGTERM)
    if mode == "echo":
        print(sys.stdin.read().upper(), end="")
    if mode == "where":
        print(json.dumps({"cwd": os.getcwd(), "value": os.environ.get(args[0]), "parent": os.getppid()}))
    if mode == "state":
        print(json.dumps(state()))
    if mode == "at-exit":
        atexit.register(print, "atexit ran")
        threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
    if mode == "basic-config":
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        logging.getLogger("cases").info("logged")
        warnings.warn("a user warning", stacklevel=1)
    if mode == "sleep":
        print("sleeping", flush=True)
        time.sleep(float(args[0]))
    return None


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
