"""What a rank writes when one of its collectives times out (or fails) or its watchdog fires: one dump per rank
under run.dir/diagnostics/, read by tools/diagnose_hang.py.

    diagnostics/rank_00002.json         the rank, its layout coordinates (tp, cp, dp, pp) and groups, the
                                        iteration, why it stopped, its latest collectives (parallel/comm.py's
                                        records: sequence number, group, kind, bytes, entered / waiting /
                                        completed / failed) and the Python stacks of every thread
    diagnostics/rank_00002.stacks.txt   the same stacks as faulthandler wrote them, for reading by eye

Stacks come from `faulthandler.dump_traceback(all_threads=True)`, which reads every thread's frames without
taking the GIL of a thread that is stuck (the public way; sys._current_frames is the private one). Each file is
written whole (a temporary name, then a rename). A new run (rank 0, at start) moves an earlier attempt's folder
to diagnostics.N, so the folder only ever holds one attempt's dumps; each dump also names its attempt (rank 0's
host:pid and start time, agreed at start), so dumps of two attempts that still meet in one folder are told apart.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import NotRequired, TypedDict, TypeGuard, get_type_hints

import torch.distributed as dist

from parallel.comm import WORLD
from parallel.comm_recorder import CommRecorder
from parallel.rank_grid import MEGATRON_ORDER
from parallel.state import ParallelState

DIAGNOSTICS = "diagnostics"
FORMAT_VERSION = 1


def diagnostics_dir(run_dir: str) -> str:
    return os.path.join(run_dir, DIAGNOSTICS)


def dump_stem(rank: int) -> str:
    return f"rank_{rank:05d}"


class RankIdentity(TypedDict, total=False):
    """rank_identity's record (a dump's first fields) with agree_on_attempt's; empty until the watchdog has
    read it."""

    rank: int
    world_size: int
    coords: dict[str, int]
    sizes: dict[str, int]
    groups: dict[str, list[int]]
    run: str  # the attempt: rank 0's host:pid, the same on every rank
    run_started: float  # rank 0's time.time() when the attempt started


class RunAttempt(TypedDict):
    """Which attempt of a run a rank belongs to (agree_on_attempt)."""

    run: str
    run_started: float


class RecordJson(TypedDict):
    """One of a dump's "records": parallel/comm.py's CommRecord as a plain dict (CommRecorder.dump())."""

    seq: int
    group: str
    group_size: int
    kind: str
    nbytes: int
    iteration: int
    region: str
    peer: int
    order: int
    state: str
    started: float
    wait_s: float
    error: str


class DumpJson(TypedDict):
    """A rank's dump (rank_XXXXX.json) as write_dump writes it: the format, the rank's identity, then why and
    where it stopped, its records, and its threads (ident -> name) and their stacks."""

    format: int
    rank: int
    world_size: int
    coords: dict[str, int]
    sizes: dict[str, int]
    groups: dict[str, list[int]]
    run: NotRequired[str]  # absent from dumps written before attempts were named
    run_started: NotRequired[float]
    iteration: int
    cause: str
    reason: str
    time: float
    host: str
    pid: int
    records: list[RecordJson]
    threads: dict[str, str]
    stacks: str


def rank_identity(state: ParallelState) -> RankIdentity:
    """Who this rank is: global rank, coordinates, and the global ranks of each of its named groups (read once
    at start: a dump written after a failure asks torch.distributed nothing)."""
    coords = {dim: state.grid.coord(state.rank, dim) for dim in MEGATRON_ORDER}
    groups: dict[str, list[int]] = {WORLD: list(range(state.world_size))}
    for name, group in state.comm.groups().items():
        if name != WORLD and group is not None:
            groups[name] = list(dist.get_process_group_ranks(group))
    sizes = {dim: state.grid.size(dim) for dim in MEGATRON_ORDER}
    return {"rank": state.rank, "world_size": state.world_size, "coords": coords, "sizes": sizes, "groups": groups}


def agree_on_attempt(state: ParallelState) -> RunAttempt:
    """Rank 0's host:pid and start time, on every rank (one all_gather_object at start, labelled "startup"):
    each dump carries it, so tools/diagnose_hang.py tells two attempts' dumps in one folder apart."""
    mine: RunAttempt = {"run": f"{socket.gethostname()}:{os.getpid()}", "run_started": time.time()}
    gathered: list[RunAttempt | None] = [None] * state.world_size
    with state.comm.region("startup", 0):
        state.comm.all_gather_object(gathered, mine)
    first = gathered[0]
    assert first is not None, "all_gather_object fills every place"
    return first


def describe_rank(rank: int, coords: dict[str, int]) -> str:
    """ "rank 2 (tp 0, cp 0, dp 0, pp 1)": the form every message and the tool use."""
    return f"rank {rank} (" + ", ".join(f"{dim} {coords[dim]}" for dim in MEGATRON_ORDER if dim in coords) + ")"


def set_aside_previous(run_dir: str) -> str | None:
    """Move an earlier attempt's diagnostics/ to diagnostics.N (first free N); returns the new name or None."""
    folder = diagnostics_dir(run_dir)
    if not os.path.isdir(folder):
        return None
    number = 1
    while os.path.exists(f"{folder}.{number}"):
        number += 1
    os.replace(folder, f"{folder}.{number}")
    return f"{folder}.{number}"


def _write_whole(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _stacks(path: str) -> str:
    """Every thread's Python stack, written by faulthandler into `path` and read back."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        faulthandler.dump_traceback(file=handle, all_threads=True)
    with open(tmp, encoding="utf-8", errors="replace") as handle:
        text = handle.read()
    os.replace(tmp, path)
    return text


def write_dump(
    run_dir: str,
    identity: RankIdentity,
    cause: str,
    reason: str,
    iteration: int,
    recorder: CommRecorder | None,
) -> str:
    """Write this rank's dump (see the module docstring); returns the JSON file's path. `cause` is "timeout"
    (a collective raised) or "watchdog"; `reason` the one line that says what happened."""
    folder = diagnostics_dir(run_dir)
    os.makedirs(folder, exist_ok=True)
    stem = os.path.join(folder, dump_stem(identity["rank"]))
    stacks = _stacks(stem + ".stacks.txt")
    threads = {f"0x{thread.ident:016x}": thread.name for thread in threading.enumerate() if thread.ident}
    dump = {
        "format": FORMAT_VERSION,
        **identity,
        "iteration": iteration,
        "cause": cause,
        "reason": reason,
        "time": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "records": recorder.dump() if recorder is not None else [],
        "threads": threads,
        "stacks": stacks,
    }
    _write_whole(stem + ".json", _readable_json(dump))
    return stem + ".json"


def _readable_json(dump: Mapping[str, object]) -> str:
    """JSON with one field per line and one record per line (a dump is also read by eye)."""
    fields = []
    for key, value in dump.items():
        if key == "records":
            assert isinstance(value, list)  # recorder.dump()'s records
            rows = ",\n".join(f"  {json.dumps(record)}" for record in value)
            fields.append(f' "records": [\n{rows}\n ]' if value else ' "records": []')
        else:
            fields.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(fields) + "\n}\n"


def _is_dump(value: object) -> TypeGuard[DumpJson]:
    """Whether a decoded JSON file is a dump of this format."""
    return isinstance(value, dict) and value.get("format") == FORMAT_VERSION and "records" in value


def _dump_names(folder: str) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.startswith("rank_") and name.endswith(".json"))


def set_aside_folders(run_dir: str) -> list[str]:
    """The diagnostics.N folders set_aside_previous made under run_dir, oldest (lowest N) first."""
    prefix = DIAGNOSTICS + "."
    numbers = [name[len(prefix) :] for name in os.listdir(run_dir) if name.startswith(prefix)]
    return [os.path.join(run_dir, f"{prefix}{n}") for n in sorted(int(n) for n in numbers if n.isdigit())]


def dumps_folder(path: str) -> tuple[str, str | None]:
    """(the folder to read dumps from, a note or None) for `path`, a run.dir or a diagnostics folder. A run.dir
    whose diagnostics/ holds no dumps while a diagnostics.N does (a resume moved them there) gives the newest
    diagnostics.N, with a note saying so."""
    if not os.path.isdir(path):
        raise ValueError(f"{path}: no such folder")
    current = diagnostics_dir(path)
    if os.path.isdir(current) and _dump_names(current):
        return current, None
    if os.path.basename(os.path.normpath(path)).startswith(DIAGNOSTICS):
        return path, None  # a diagnostics folder given itself
    earlier = [folder for folder in set_aside_folders(path) if _dump_names(folder)]
    if earlier:
        return earlier[-1], (
            f"{current} holds no dumps: reading {earlier[-1]}, the dumps of an earlier attempt (moved there when "
            f"the run restarted)"
        )
    return (current if os.path.isdir(current) else path), None


def _type_problem(value: object, hint: object, where: str) -> str | None:
    """Where `value` does not have the type `hint` (int, float, str, dict[str, X], list[X], a TypedDict whose
    _READ_FIELDS must be present): a dump is input, and a wrong type is named here, not a TypeError later."""
    origin = getattr(hint, "__origin__", None)
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int or hint is str:
        ok = isinstance(value, hint) and not isinstance(value, bool)
    elif origin is dict:
        if not isinstance(value, dict):
            return f"{where} is not an object"
        inner = hint.__args__[1]  # type: ignore[attr-defined]
        return next((p for k, v in value.items() if (p := _type_problem(v, inner, f"{where}.{k}"))), None)
    elif origin is list:
        if not isinstance(value, list):
            return f"{where} is not a list"
        inner = hint.__args__[0]  # type: ignore[attr-defined]
        return next((p for i, v in enumerate(value) if (p := _type_problem(v, inner, f"{where}[{i}]"))), None)
    elif isinstance(hint, type) and issubclass(hint, dict):  # a TypedDict
        if not isinstance(value, dict):
            return f"{where} is not an object"
        for key, inner in get_type_hints(hint).items():
            field = f"{where}.{key}" if where else key
            if key in value:
                problem = _type_problem(value[key], inner, field)
                if problem:
                    return problem
            elif key in _READ_FIELDS.get(hint.__name__, ()):
                return f"{field} is missing"
        return None
    else:
        return None  # NotRequired[...] is unwrapped by get_type_hints; nothing else is declared
    return None if ok else f"{where} is {json.dumps(value)[:40]}, not {getattr(hint, '__name__', hint)}"


# The fields tools/diagnose_hang.py reads: a dump lacking one cannot be analysed (others are optional).
_READ_FIELDS = {
    "DumpJson": ("rank", "world_size", "coords", "groups", "iteration", "cause", "records"),
    "RecordJson": ("seq", "group", "kind", "nbytes", "iteration", "region", "peer", "order", "state", "error"),
}


def read_dumps(folder: str) -> list[DumpJson]:
    """Every rank's dump in `folder` (a run.dir or its diagnostics/), by rank. ValueError (one line naming the
    file) for a folder without dumps or a file that is not one."""
    if os.path.isdir(diagnostics_dir(folder)):
        folder = diagnostics_dir(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"{folder}: no such folder")
    names = _dump_names(folder)
    if not names:
        raise ValueError(f"{folder}: no rank_*.json dumps (a run writes them on a timeout or a watchdog stop)")
    dumps = []
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path, encoding="utf-8") as handle:
                dump = json.load(handle)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a readable dump ({err})") from None
        if not _is_dump(dump):
            raise ValueError(f"{path}: not a dump of format {FORMAT_VERSION}")
        problem = _type_problem(dump, DumpJson, "")
        if problem:
            raise ValueError(f"{path}: not a readable dump ({problem})")
        dumps.append(dump)
    return sorted(dumps, key=lambda dump: dump["rank"])
