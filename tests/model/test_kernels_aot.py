"""Every Triton kernel compiled ahead of time for A100 (sm_80), H100/H200 (sm_90) and Blackwell (sm_100, when
the wheel's ptxas supports it) on this CPU-only machine (model/kernels/aot.py): no compile error, no register
spill that model/kernels/aot.ACCEPTED_SPILLS does not name, shared memory within the target's limit.
Run with -s to see registers / spills / shared memory per kernel."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")
aot = pytest.importorskip("model.kernels.aot")


@pytest.fixture(scope="module")
def compiled() -> dict[int, list]:
    """Every configuration compiled for every supported arch once, on two processes (CI has two cores)."""
    archs = aot.supported_archs()
    results = aot.compile_all(aot.kernel_configs(), archs, workers=min(2, os.cpu_count() or 1))
    by_arch: dict[int, list] = {arch: [] for arch in archs}
    for result in results:
        arch = int(result.split()[0][3:]) if isinstance(result, str) else result.arch
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
    jitted = {name for name in dir(aot.tk) if hasattr(getattr(aot.tk, name), "arg_names")}
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
