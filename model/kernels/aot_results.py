"""The AOT kernel table, recorded: what compiling every configuration of `aot.kernel_configs()` for every target
gave (registers, spilled bytes, shared memory, warps, or the compile error), committed as aot_results.json
beside this file, so that the test suite compiles only when a kernel or the toolchain changed.

A cold compile of the 543 cubins costs minutes (the 471 before the grouped multiply took ~125 CPU s; its 72 are
heavier, 1.5-6 s each measured on the loaded 2-core machine; a clean CI machine has an empty Triton cache);
reading the table costs nothing. Regenerate it after changing a kernel, the configurations, Triton or its ptxas:

    python scripts/write_aot_results.py

What the table is keyed by, at two levels:
- one fingerprint of the inputs every entry shares: the source of model/kernels/triton_kernels.py and of every
  project module it imports, the source of the compile procedure (`aot.compile_for`, `aot._local_memory`), the
  Triton version, `ptxas --version` of the ptxas Triton runs for each target (sm_100 has its own), the
  cuobjdump that reads the spills, and the environment variables Triton's own cache key reads. A change to any
  of them can change any entry (the kernels share one file, its module-level constants and one compiler), so
  the whole table is stale: simpler and safer than tracing which kernel uses what, at the price of a full
  recompile after a comment edit. (Triton's own `triton_key()` would also hash libtriton.so, which differs
  between the Python builds of one release: every other Python would recompile for nothing.);
- each entry's own key: a hash of its target and complete configuration (kernel, every argument's type,
  constexprs, warps). A configuration added or changed (a new block size the launch code picks) is compiled
  alone; the others still come from the table.
tests/model/test_kernels_aot.py compiles what the table lacks (saying the table is stale and how to regenerate
it), and checks a fixed sample of entries against a fresh compile on every run, so that a wrong table or an
input the fingerprint misses shows up as a difference.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import triton

from model.kernels import aot
from model.kernels.aot import CompileResult, KernelConfig

RESULTS_PATH = Path(__file__).with_name("aot_results.json")
REGENERATE = "python scripts/write_aot_results.py"
_REPO_ROOT = Path(__file__).resolve().parents[2]
_COMPILE_PROCEDURE = (aot.jit_function, aot.compile_for, aot._local_memory)

Job = tuple[KernelConfig, int]  # a configuration and the sm version it is compiled for


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def project_module_file(name: str) -> Path | None:
    """The source file of module `name` when it is part of this project (not Triton, not installed packages)."""
    if name.split(".")[0] == "triton":
        return None  # the Triton version and ptxas versions stand for it
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    return origin if origin is not None and _REPO_ROOT in origin.parents else None


def kernel_sources() -> dict[str, str]:
    """sha256 of the kernels' module and of every project module it imports (recursively), and of the source of
    the compile procedure, by name."""
    hashes: dict[str, str] = {}
    pending = ["model.kernels.triton_kernels"]
    while pending:
        name = pending.pop()
        path = project_module_file(name)
        if name in hashes or path is None:
            continue
        source = path.read_bytes()
        hashes[name] = _sha256(source)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                pending += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                pending += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    for function in _COMPILE_PROCEDURE:
        hashes[f"{function.__module__}.{function.__qualname__}"] = _sha256(inspect.getsource(function).encode())
    return dict(sorted(hashes.items()))


def _version_text(command: list[str]) -> str:
    """`command`'s version output on one line, without its copyright line."""
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return "; ".join(line.strip() for line in output.splitlines() if line.strip() and "Copyright" not in line)


def ptxas_path(arch: int) -> str:
    """The ptxas Triton runs for sm_`arch` (TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH honoured)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(arch).path


def _triton_env() -> dict[str, str]:
    """The environment variables that Triton's own compile cache is keyed by (the ones set)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars

    return dict(sorted(get_cache_invalidating_env_vars().items()))


def fingerprint_inputs(archs: list[int]) -> dict:
    """Everything besides the configuration that decides what a compile gives, readable (see the docstring)."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return {
        "triton": triton.__version__,
        "ptxas": {f"sm_{arch}": _version_text([ptxas_path(arch), "--version"]) for arch in archs},
        "cuobjdump": _version_text([os.path.join(bin_dir, "cuobjdump"), "--version"]),
        "triton_env": _triton_env(),
        "sources": kernel_sources(),
    }


def fingerprint(inputs: dict) -> str:
    return _sha256(json.dumps(inputs, sort_keys=True).encode())


def job_key(job: Job) -> str:
    """The entry's key: a hash of the target and the complete configuration (every argument's type included)."""
    config, arch = job
    spelled = [arch, config.kernel, config.types, config.constexprs, config.num_warps]
    return _sha256(json.dumps(spelled).encode())[:16]


def to_entry(job: Job, result: CompileResult | str) -> dict:
    """One line of the table: the job, readable and keyed, and what its compile gave."""
    config, arch = job
    entry: dict = {"sm": arch, "config": config.label(), "warps": config.num_warps, "key": job_key(job)}
    if isinstance(result, str):
        return entry | {"error": result}
    return entry | {
        "registers": result.registers,
        "local_bytes": result.local_bytes,
        "shared_bytes": result.shared_bytes,
        "num_warps": result.num_warps,
    }


def from_entry(job: Job, entry: dict) -> CompileResult | str:
    config, arch = job
    if "error" in entry:
        return entry["error"]
    fields = (entry["registers"], entry["local_bytes"], entry["shared_bytes"], entry["num_warps"])
    return CompileResult(config, arch, *fields)


@dataclass(frozen=True)
class RecordedTable:
    """aot_results.json as read: the fingerprint's inputs and the entries by key."""

    inputs: dict
    fingerprint: str
    entries: dict[str, dict]


def load(path: Path = RESULTS_PATH) -> RecordedTable | None:
    """The recorded table, or None when there is none."""
    if not path.exists():
        return None
    table = json.loads(path.read_text())
    return RecordedTable(table["inputs"], table["fingerprint"], {entry["key"]: entry for entry in table["results"]})


def write(jobs: list[Job], results: list[CompileResult | str], inputs: dict, path: Path = RESULTS_PATH) -> None:
    """The table as JSON, one entry per line (readable diffs), written whole or not at all."""
    header = {
        "about": "model/kernels/aot.py's compile of every kernel configuration for every target (see aot_results.py)",
        "regenerate": REGENERATE,
        "fingerprint": fingerprint(inputs),
        "inputs": inputs,
    }
    lines = ",\n".join(f"    {json.dumps(to_entry(job, result))}" for job, result in zip(jobs, results))
    text = json.dumps(header, indent=2)[: -len("\n}")] + ',\n  "results": [\n' + lines + "\n  ]\n}\n"
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _changed_inputs(recorded: dict, current: dict, prefix: str = "") -> list[str]:
    """The names of the fingerprint's inputs that differ, e.g. 'ptxas.sm_90', 'sources.model.kernels.aot...'."""
    changed = []
    for name in sorted(set(recorded) | set(current)):
        old, new = recorded.get(name), current.get(name)
        if isinstance(old, dict) and isinstance(new, dict):
            changed += _changed_inputs(old, new, f"{prefix}{name}.")
        elif old != new:
            changed.append(f"{prefix}{name}")
    return changed


def staleness(recorded: RecordedTable | None, inputs: dict, jobs: list[Job]) -> str | None:
    """Why the recorded table does not answer `jobs` as it is, or None when it does."""
    if recorded is None:
        return "no table recorded"
    if recorded.fingerprint != fingerprint(inputs):
        return "changed since it was recorded: " + ", ".join(_changed_inputs(recorded.inputs, inputs))
    keys = {job_key(job) for job in jobs}
    missing, unused = len(keys - set(recorded.entries)), len(set(recorded.entries) - keys)
    if missing or unused:
        return f"{missing} configuration(s) not recorded, {unused} recorded configuration(s) no longer compiled"
    return None


def matching(recorded: RecordedTable | None, inputs: dict) -> RecordedTable | None:
    """`recorded` when its fingerprint is that of `inputs` (its entries hold), else None."""
    return recorded if recorded is not None and recorded.fingerprint == fingerprint(inputs) else None


def stale_note(path: Path, reason: str, consequence: str) -> str:
    """The one line a test prints for a stale table: why, what that cost, and the command that regenerates it."""
    shown = path.resolve().relative_to(_REPO_ROOT) if _REPO_ROOT in path.resolve().parents else path
    return f"{shown} is stale ({reason}): {consequence}; regenerate it with `{REGENERATE}`"


def recorded_or_compiled(
    jobs: list[Job], workers: int, path: Path = RESULTS_PATH
) -> tuple[list[CompileResult | str], str | None]:
    """Each job's result: from the recorded table where its fingerprint matches, else compiled (aot.compile_jobs).
    Returns the results in `jobs`' order and, when the table did not answer exactly `jobs`, a one-line note
    saying it is stale and how to regenerate it."""
    inputs = fingerprint_inputs(sorted({arch for _, arch in jobs}))
    recorded = load(path)
    table = matching(recorded, inputs)
    usable = table.entries if table is not None else {}
    missing = [job for job in jobs if job_key(job) not in usable]
    fresh = dict(zip(missing, aot.compile_jobs(missing, workers)))
    results = [fresh[job] if job in fresh else from_entry(job, usable[job_key(job)]) for job in jobs]
    reason = staleness(recorded, inputs, jobs)
    return results, None if reason is None else stale_note(path, reason, f"compiled {len(missing)} of {len(jobs)}")


def all_jobs() -> list[Job]:
    """Every configuration for every target this Triton compiles for, target by target."""
    return [(config, arch) for arch in aot.supported_archs() for config in aot.kernel_configs()]


def rebuild_sample(jobs: list[Job], table: RecordedTable) -> list[Job]:
    """The recorded entries compiled again on every test run (~10 compiles, a few CPU seconds): each kernel's
    first configuration, the kernels dealt round-robin over the targets (every kernel and every target's ptxas
    exercised), and on each target the first configuration the table says spills (a nonzero local-memory
    figure compared too); chosen among the jobs the table records."""
    jobs = [job for job in jobs if job_key(job) in table.entries]
    archs = sorted({arch for _, arch in jobs})
    firsts: dict[str, KernelConfig] = {}
    for config, _ in jobs:
        firsts.setdefault(config.kernel, config)
    sample = [(config, archs[i % len(archs)]) for i, config in enumerate(firsts.values())]
    for arch in archs:
        spills = (job for job in jobs if job[1] == arch and table.entries[job_key(job)].get("local_bytes"))
        sample += [spill for spill in [next(spills, None)] if spill is not None]
    return sample
