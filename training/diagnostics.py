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
to diagnostics.N, so the folder only ever holds one attempt's dumps.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import TypedDict, TypeGuard

import torch.distributed as dist

from parallel.comm import WORLD, CommRecorder
from parallel.rank_grid import MEGATRON_ORDER
from parallel.state import ParallelState

DIAGNOSTICS = "diagnostics"
FORMAT_VERSION = 1


def diagnostics_dir(run_dir: str) -> str:
    return os.path.join(run_dir, DIAGNOSTICS)


def dump_stem(rank: int) -> str:
    return f"rank_{rank:05d}"


class RankIdentity(TypedDict, total=False):
    """rank_identity's record (a dump's first fields); empty until the watchdog has read it."""

    rank: int
    world_size: int
    coords: dict[str, int]
    sizes: dict[str, int]
    groups: dict[str, list[int]]


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


def read_dumps(folder: str) -> list[DumpJson]:
    """Every rank's dump in `folder` (a run.dir or its diagnostics/), by rank. ValueError (one line) for a
    folder without dumps or a file that is not one."""
    if os.path.isdir(diagnostics_dir(folder)):
        folder = diagnostics_dir(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"{folder}: no such folder")
    names = sorted(name for name in os.listdir(folder) if name.startswith("rank_") and name.endswith(".json"))
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
        dumps.append(dump)
    return sorted(dumps, key=lambda dump: dump["rank"])
