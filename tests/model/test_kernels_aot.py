"""Every Triton kernel compiled ahead of time for A100 (sm_80), H100/H200 (sm_90) and Blackwell (sm_100, when
the wheel's ptxas supports it) on this CPU-only machine (model/kernels/aot.py): no compile error, no register
spill that model/kernels/aot.ACCEPTED_SPILLS does not name, shared memory within the target's limit.
The results come from model/kernels/aot_results.json when its fingerprint (kernel sources, Triton, ptxas, ...)
matches this machine, else from compiling (with a warning that the table is stale and how to regenerate it);
a sample of the table is compiled again on every run and must match it exactly.
Run with -s to see registers / spills / shared memory per kernel."""

from __future__ import annotations

import os
import warnings

import pytest

pytestmark = pytest.mark.tier("full")  # the kernels' ahead-of-time compile table

pytest.importorskip("triton")
aot = pytest.importorskip("model.kernels.aot")
aot_results = pytest.importorskip("model.kernels.aot_results")


@pytest.fixture(scope="module")
def compiled() -> dict[int, list]:
    """Every configuration for every supported arch: recorded, or compiled once on two processes (CI has two
    cores) where the recorded table is stale."""
    jobs = aot_results.all_jobs()
    results, stale = aot_results.recorded_or_compiled(jobs, workers=min(2, os.cpu_count() or 1))
    if stale is not None:
        warnings.warn(stale, stacklevel=1)
    by_arch: dict[int, list] = {arch: [] for arch in aot.supported_archs()}
    for (_, arch), result in zip(jobs, results):
        by_arch[arch].append(result)
    return by_arch


def _results(compiled: dict[int, list], arch: int) -> list:
    if arch not in compiled:
        pytest.skip(f"this Triton's ptxas cannot compile for sm_{arch}")
    return compiled[arch]


@pytest.mark.parametrize("arch", [80, 90, 100])
def test_every_kernel_compiles(compiled, arch):
    results = _results(compiled, arch)
    errors = [result for result in results if isinstance(result, str)]
    assert not errors, "\n".join(errors)
    assert len(results) == len(aot.kernel_configs())
    for result in results:
        print(result.line())


@pytest.mark.parametrize("arch", [80, 90, 100])
def test_no_unexplained_register_spills(compiled, arch):
    spilled = [r for r in _results(compiled, arch) if not isinstance(r, str) and r.local_bytes > 0]
    unexplained = [r.line() for r in spilled if aot.accepted_spill(r) is None]
    assert not unexplained, "register spills no ACCEPTED_SPILLS entry names:\n" + "\n".join(unexplained)
    for result in spilled:
        print(f"accepted: {result.line()}: {aot.accepted_spill(result).reason}")


@pytest.mark.parametrize("arch", [80, 90, 100])
def test_shared_memory_within_the_target_limit(compiled, arch):
    limit = aot.MAX_SHARED_BYTES[arch]
    over = [r.line() for r in _results(compiled, arch) if not isinstance(r, str) and r.shared_bytes > limit]
    assert not over, f"over sm_{arch}'s {limit} B of shared memory per block:\n" + "\n".join(over)


def test_configs_cover_every_kernel_and_dtype():
    configs = aot.kernel_configs()
    kernels = {config.kernel for config in configs}
    # helpers (a leading underscore) are launched only inside the kernels that call them, compiled with them
    jitted = {name for name in dir(aot.tk) if hasattr(getattr(aot.tk, name), "arg_names") and name[0] != "_"}
    assert kernels == jitted
    for dtype in aot.DTYPES:
        covered = {c.kernel for c in configs if any(t == f"*{dtype}" for _, t in c.types)}
        assert covered >= jitted - {"ce_chunk_stats", "ce_chunk_grad"}  # the loss kernels read fp32 logits


def test_a_spill_is_detected_and_must_be_named():
    """The detector itself: norm_bwd forced to 4 warps at h = 16384 spills, and the entry naming it applies."""
    config = next(c for c in aot.norm_configs("fp32", 16384, ((False, True),)) if c.kernel == "norm_bwd")
    narrow = aot.KernelConfig(config.kernel, config.types, config.constexprs, num_warps=4)
    (result,) = aot.compile_all([narrow], [90], workers=1)
    assert result.local_bytes > 0
    assert aot.accepted_spill(result) is None  # 4 warps spill more than the entry accepts


def test_recorded_entries_match_a_fresh_compile():
    """A sample of the recorded table (every kernel, every target, a spill per target) compiled again: a wrong
    entry, or an input that changes results but that the fingerprint misses, shows up as a difference."""
    jobs = aot_results.all_jobs()
    inputs = aot_results.fingerprint_inputs(aot.supported_archs())
    recorded = aot_results.load()
    table = aot_results.matching(recorded, inputs)
    if table is None:
        reason = aot_results.staleness(recorded, inputs, jobs)
        pytest.skip(aot_results.stale_note(aot_results.RESULTS_PATH, reason, "no recorded entry to compare"))
    sample = aot_results.rebuild_sample(jobs, table)
    assert {config.kernel for config, _ in sample} == {config.kernel for config, _ in jobs}
    assert {arch for _, arch in sample} == set(aot.supported_archs())
    fresh = [aot_results.to_entry(job, result) for job, result in zip(sample, aot.compile_jobs(sample, workers=1))]
    entries = [table.entries[aot_results.job_key(job)] for job in sample]
    differing = [f"recorded {old}\ncompiled {new}" for old, new in zip(entries, fresh) if old != new]
    assert not differing, (
        "the recorded table differs from a fresh compile: a wrong entry, or an input that changes results but "
        f"not the fingerprint (add it to aot_results.fingerprint_inputs); then `{aot_results.REGENERATE}`:\n"
        + "\n".join(differing)
    )


def test_the_fingerprint_says_what_changed(tmp_path, monkeypatch):
    """A table written and read back answers its jobs; a changed input or a configuration it lacks makes it
    stale, only what it lacks is compiled, and the note names the input and the command that regenerates it."""
    jobs = aot_results.all_jobs()[:3]
    results = [aot.CompileResult(config, arch, 32, 0, 0, config.num_warps) for config, arch in jobs]
    inputs = aot_results.fingerprint_inputs(sorted({arch for _, arch in jobs}))
    assert {"model.kernels.triton_kernels", "model.kernels.aot.compile_for"} <= set(inputs["sources"])
    assert aot_results.project_module_file("triton.language") is None  # the Triton version stands for it
    path = tmp_path / "aot_results.json"
    aot_results.write(jobs[:2], results[:2], inputs, path)
    table = aot_results.matching(aot_results.load(path), inputs)
    assert [aot_results.from_entry(job, table.entries[aot_results.job_key(job)]) for job in jobs[:2]] == results[:2]
    assert aot_results.staleness(table, inputs, jobs[:2]) is None
    assert aot_results.recorded_or_compiled(jobs[:2], workers=1, path=path) == (results[:2], None)

    compiled_jobs: list = []
    monkeypatch.setattr(aot, "compile_jobs", lambda todo, workers: compiled_jobs.extend(todo) or results[2:])
    answered, note = aot_results.recorded_or_compiled(jobs, workers=1, path=path)
    assert answered == results and compiled_jobs == jobs[2:]
    assert note == (
        f"{path} is stale (1 configuration(s) not recorded, 0 recorded configuration(s) no longer "
        f"compiled): compiled 1 of 3; regenerate it with `{aot_results.REGENERATE}`"
    )
    ptxas = next(iter(inputs["ptxas"]))
    changed = inputs | {"ptxas": inputs["ptxas"] | {ptxas: "another ptxas"}}
    assert aot_results.matching(table, changed) is None
    assert aot_results.staleness(table, changed, jobs[:2]) == f"changed since it was recorded: ptxas.{ptxas}"
