"""Ahead-of-time compilation of every Triton kernel for real GPU targets, on a machine without a GPU.

Triton's interpreter forgives what a GPU compile rejects (a plain Python global inside a kernel, unsupported
layouts, block shapes that spill registers or overflow shared memory). `triton.compile(ASTSource(...),
target=GPUTarget("cuda", arch, 32))` runs the whole pipeline down to a cubin with the ptxas the wheel ships,
so tests/model/test_kernels_aot.py compiles each kernel for A100 (sm_80), H100/H200 (sm_90) and Blackwell
(sm_100, when the wheel's ptxas knows it) and reads registers, spills and shared memory off the result.

What is compiled (`kernel_configs`): every block configuration the launch code in ops.py / cross_entropy.py
can pick (the same functions choose them here, for hidden sizes, heads and head dims up to the paper's
largest), in fp32, bf16 and fp16, with each kernel's heaviest branch (bias, mask, LayerNorm); and every
branch (HAS_BIAS, IS_RMS, BACKWARD, ...) once at a representative size. Pointers are marked 16-byte aligned,
as Triton's launcher marks the contiguous tensors ops.py hands it, so the code is the vectorised code a GPU runs.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from model.kernels import triton_kernels as tk
from model.kernels.backend import interpreter_on
from model.kernels.cross_entropy import ce_blocks
from model.kernels.ops import (
    ELEMENTWISE_BLOCK,
    grouped_mm_blocks,
    grouped_mm_row_trips,
    rows_per_block,
    warps_for,
)

# sm -> the largest dynamic shared memory one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes
MAX_SHARED_BYTES = {80: 166912, 90: 232448, 100: 232448}
GPU_NAMES = {80: "A100", 90: "H100/H200", 100: "B200"}
DTYPES = ("fp32", "bf16", "fp16")
_CUDA = torch.device("cuda")  # the launch helpers only read device.type: no GPU is touched
_MANY_ROWS = 1 << 20  # tokens of a real micro-batch: enough that no block size is capped by the row count
HIDDEN_SIZES = tuple(1 << p for p in range(6, 16))  # 64 .. 32768 (the paper's 1T model: h = 25600)
HEADS_PER_RANK = tuple(1 << p for p in range(0, 8))  # 1 .. 128
HEAD_DIMS = (16, 32, 64, 128, 256)
VOCAB_SHARDS = (256, 50304)  # below and above the 1024-column block of the cross-entropy kernels
# (experts, hidden, expert FFN width x 2 for SwiGLU's [gate; up]) of the grouped experts' multiplies
MIXTRAL_8X7B_EXPERTS = (8, 4096, 2 * 14336)
DEEPSEEK_V3_EXPERTS = (256, 7168, 2 * 2048)
GROUPED_MM_PRODUCTS = ("forward", "input_grad", "weight_grad")
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class KernelConfig:
    """One compilation: a kernel of model/kernels/triton_kernels.py, its argument types and constexprs."""

    kernel: str
    types: tuple[tuple[str, str], ...]  # (argument, Triton type) of the runtime arguments, in order
    constexprs: tuple[tuple[str, int | bool], ...]
    num_warps: int = 4  # as the launch in ops.py / cross_entropy.py asks (Triton's default: 4)

    def label(self) -> str:
        dtypes = sorted({t[1:] for _, t in self.types if t.startswith("*")})
        consts = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.constexprs)
        return f"{self.kernel}[{'/'.join(dtypes)}]({consts})"


@dataclass(frozen=True)
class CompileResult:
    """What one compile produced for one target: registers, local memory (spills) and shared memory."""

    config: KernelConfig
    arch: int
    registers: int
    local_bytes: int  # per-thread local memory + stack: register spills (Triton kernels use no local arrays)
    shared_bytes: int  # dynamic shared memory the launch asks for (Triton checks it against the device)
    num_warps: int

    def line(self) -> str:
        return (
            f"sm_{self.arch} {self.config.label()}: {self.registers} registers, {self.local_bytes} B spilled, "
            f"{self.shared_bytes} B shared, {self.num_warps} warps"
        )


def jit_function(kernel: str) -> JITFunction:
    """The compilable form of a kernel of triton_kernels, also when the interpreter (TRITON_INTERPRET=1)
    defined it: then `triton.jit` gave an InterpretedFunction, and its Python function is recompiled."""
    defined = getattr(tk, kernel)
    return defined if isinstance(defined, JITFunction) else JITFunction(defined.fn)


def _config(
    kernel: str, dtype: str, pointer_types: dict[str, str], num_warps: int = 4, **constexprs: int | bool
) -> KernelConfig:
    """A KernelConfig of `kernel`: pointers not in pointer_types are `dtype`; ints i32, floats fp32."""
    fn = jit_function(kernel)
    types = []
    for param in fn.params:
        if param.is_constexpr:
            continue
        name = param.name
        if name.endswith("_ptr"):
            types.append((name, pointer_types.get(name, f"*{dtype}")))
        else:
            types.append((name, "fp32" if name == "eps" else "i32"))
    return KernelConfig(kernel, tuple(types), tuple(constexprs.items()), num_warps)


def elementwise_configs(dtype: str, every_branch: bool) -> list[KernelConfig]:
    """bias+GeLU, bias+SwiGLU, bias+dropout+add and mul (the one block size ops.py launches)."""
    block, cols = ELEMENTWISE_BLOCK, 2048
    flags = (True, False) if every_branch else (True,)
    configs = [_config("mul_fwd", dtype, {}, BLOCK=block)]
    for has_bias in flags:
        configs += [_config(k, dtype, {}, N_COLS=cols, HAS_BIAS=has_bias, BLOCK=block) for k in ("bias_gelu_fwd",)]
        configs.append(_config("bias_gelu_bwd", dtype, {}, N_COLS=cols, HAS_BIAS=has_bias, BLOCK=block))
        for kernel in ("bias_swiglu_fwd", "bias_swiglu_bwd"):
            configs.append(_config(kernel, dtype, {}, F=cols, HAS_BIAS=has_bias, BLOCK=block))
        for has_mask in flags:
            configs.append(
                _config(
                    "bias_dropout_add_fwd", dtype, {}, N_COLS=cols, HAS_BIAS=has_bias, HAS_MASK=has_mask, BLOCK=block
                )
            )
    return configs


def norm_configs(dtype: str, hidden: int, variants: tuple[tuple[bool, bool], ...]) -> list[KernelConfig]:
    """norm_fwd / norm_bwd at the blocks ops.Norm picks for `hidden`; variants: (IS_RMS, HAS_BIAS) pairs."""
    block_h = triton.next_power_of_2(hidden)
    block_rows = rows_per_block(block_h, _MANY_ROWS, _CUDA)
    stats = {"mean_ptr": "*fp32", "rstd_ptr": "*fp32", "dw_part_ptr": "*fp32", "db_part_ptr": "*fp32"}
    warps = warps_for(block_h * block_rows)
    configs = []
    for is_rms, has_bias in variants:
        shape = {"H": hidden, "BLOCK_H": block_h, "BLOCK_ROWS": block_rows, "IS_RMS": is_rms, "HAS_BIAS": has_bias}
        configs.append(_config("norm_fwd", dtype, stats, warps, **shape))
        configs.append(_config("norm_bwd", dtype, stats, warps, **shape, ITERS=4))
    return configs


def rotary_configs(dtype: str, heads: int, head_dim: int, directions: tuple[bool, ...]) -> list[KernelConfig]:
    """rotary_kernel at the blocks ops._rotate picks for `heads` per rank of `head_dim`."""
    block_heads, block_half = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim // 2)
    block_t = rows_per_block(block_heads * block_half, _MANY_ROWS, _CUDA)
    shape = {"N_HEADS": heads, "D": head_dim, "BLOCK_T": block_t, "BLOCK_HEADS": block_heads, "BLOCK_HALF": block_half}
    return [
        _config("rotary_kernel", dtype, {}, warps_for(block_t * block_heads * block_half), **shape, BACKWARD=backward)
        for backward in directions
    ]


def cross_entropy_configs(vocab_local: int) -> list[KernelConfig]:
    """ce_chunk_stats / ce_chunk_grad (fp32 logits, int64 targets) at the blocks cross_entropy.ce_blocks picks."""
    block_r, block_v = ce_blocks(_MANY_ROWS, vocab_local, _CUDA)
    types = {"target_ptr": "*i64"}
    shape = {"V": vocab_local, "BLOCK_R": block_r, "BLOCK_V": block_v}
    return [_config(k, "fp32", types, **shape) for k in ("ce_chunk_stats", "ce_chunk_grad")]


def grouped_mm_configs(dtype: str, experts: tuple[int, int, int]) -> list[KernelConfig]:
    """grouped_mm for fc1 (hidden -> ffn) and fc2 (ffn -> hidden) of `experts` = (E, hidden, fc1 width), each
    as its forward, input gradient and weight gradient, at the blocks ops.grouped_mm_blocks picks (compiled:
    UPCAST off)."""
    num_experts, hidden, fc1_width = experts
    blocks = grouped_mm_blocks(_BYTES[dtype], _CUDA)
    tiles = {"BLOCK_M": blocks.block_m, "BLOCK_N": blocks.block_n, "BLOCK_K": blocks.block_k}
    common = {"E": num_experts, "BLOCK_E": triton.next_power_of_2(num_experts), **tiles, "UPCAST": False}
    configs = []
    for n_out, k_in in ((fc1_width, hidden), (hidden, fc1_width // 2)):  # (N, K) of the weights [E, N, K]
        for product in GROUPED_MM_PRODUCTS:
            if product == "weight_grad":
                trips = grouped_mm_row_trips(_MANY_ROWS, blocks.block_k)
                shape = {"M": n_out, "N": k_in, "K": 0, "GROUPED_K": True, "B_NK": False, "K_TRIPS": trips}
            else:
                forward = product == "forward"
                n, k = (n_out, k_in) if forward else (k_in, n_out)
                shape = {
                    "M": 0,
                    "N": n,
                    "K": k,
                    "GROUPED_K": False,
                    "B_NK": forward,
                    "K_TRIPS": -(-k // tiles["BLOCK_K"]),
                }
            values = common | shape
            ordered = {p.name: values[p.name] for p in jit_function("grouped_mm").params if p.is_constexpr}
            configs.append(_config("grouped_mm", dtype, {"ends_ptr": "*i32"}, blocks.num_warps, **ordered))
    return configs


def kernel_configs() -> list[KernelConfig]:
    """Every configuration to compile, without duplicates (see the module docstring)."""
    configs: list[KernelConfig] = []
    heaviest_norm = ((False, True),)
    # fp32 and bf16 sweep the block sizes (fp16 has bf16's register footprint); fp16 at one size per kernel
    for dtype in DTYPES:
        configs += elementwise_configs(dtype, every_branch=dtype == "bf16")
        sweep = dtype != "fp16"
        for hidden in HIDDEN_SIZES if sweep else (2048,):
            configs += norm_configs(dtype, hidden, heaviest_norm)
        for heads in HEADS_PER_RANK if sweep else (16,):
            for head_dim in HEAD_DIMS if sweep else (128,):
                configs += rotary_configs(dtype, heads, head_dim, (False,))
    configs += norm_configs("bf16", 2048, ((False, False), (True, False)))  # no bias, RMSNorm
    configs += rotary_configs("bf16", 16, 128, (True,))  # the backward rotation
    for vocab_local in VOCAB_SHARDS:
        configs += cross_entropy_configs(vocab_local)
    # every dtype at Mixtral's sizes; bf16 (the dtype MoE models train in) also at DeepSeek-V3's 256 experts
    for dtype in DTYPES:
        configs += grouped_mm_configs(dtype, MIXTRAL_8X7B_EXPERTS)
    configs += grouped_mm_configs("bf16", DEEPSEEK_V3_EXPERTS)
    return list(dict.fromkeys(configs))


def supported_archs() -> list[int]:
    """The sm versions of MAX_SHARED_BYTES this Triton can compile for (Blackwell needs its ptxas)."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    blackwell = os.path.exists(os.path.join(bin_dir, "ptxas-blackwell"))
    return [arch for arch in MAX_SHARED_BYTES if arch < 100 or blackwell]


def _local_memory(cubin: bytes) -> tuple[int, int]:
    """(registers, local + stack bytes per thread) of the one kernel in `cubin`, read by the wheel's cuobjdump."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        usage = subprocess.run(
            [cuobjdump, "--dump-resource-usage", handle.name], capture_output=True, text=True, check=True
        ).stdout
    fields = {key: int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
    return fields["REG"], fields["STACK"] + fields["LOCAL"]


def compile_for(config: KernelConfig, arch: int) -> CompileResult:
    """Compile `config` to a cubin for sm_`arch`; raises Triton's CompilationError (or ptxas's) on failure."""
    fn = jit_function(config.kernel)
    signature = dict(config.types) | {name: "constexpr" for name, _ in config.constexprs}
    index = {param.name: i for i, param in enumerate(fn.params)}
    aligned = {(index[name],): [["tt.divisibility", 16]] for name, kind in config.types if kind.startswith("*")}
    source = ASTSource(fn=fn, signature=signature, constexprs=dict(config.constexprs), attrs=aligned)
    if interpreter_on():
        # the kernels (and tl.sum & co.) were defined for the interpreter: compile_all compiles in fresh
        # processes with it off
        raise RuntimeError("TRITON_INTERPRET=1 is set: compile through compile_all, which compiles without it")
    options = {"num_warps": config.num_warps}
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    registers, local_bytes = _local_memory(compiled.asm["cubin"])
    return CompileResult(config, arch, registers, local_bytes, compiled.metadata.shared, compiled.metadata.num_warps)


@dataclass(frozen=True)
class AcceptedSpill:
    """A spill the AOT test lets through: which compilations (kernel, constexpr lower bounds) and why."""

    kernel: str
    at_least: tuple[tuple[str, int], ...]  # every named constexpr >= this value
    max_bytes: int
    reason: str

    def covers(self, result: CompileResult) -> bool:
        if result.config.kernel != self.kernel:
            return False
        consts = dict(result.config.constexprs)
        big_enough = all(int(consts[name]) >= low for name, low in self.at_least)
        return big_enough and result.local_bytes <= self.max_bytes


ACCEPTED_SPILLS = (
    AcceptedSpill(
        "norm_bwd",
        (("BLOCK_H", 16384),),
        4096,
        "h > 8192 (the paper's 76B-1T models): one row's five fp32 tensors exceed 16 warps' registers; "
        "needs a column-looped backward, as Megatron's Apex kernel; correct, slower",
    ),
    AcceptedSpill(
        "norm_fwd",
        (("BLOCK_H", 32768),),
        64,
        "h > 16384 (the paper's 310B-1T models): 64 fp32 per thread on 16 warps; sm_100's ptxas stores 16 B",
    ),
    AcceptedSpill(
        "rotary_kernel",
        (("BLOCK_HALF", 64),),
        16,
        "16-bit q/k with head_dim >= 128: ptxas keeps 64 registers for occupancy and stores one 8-byte value "
        "to the stack (measured 8 B); not worth fewer threads",
    ),
    AcceptedSpill(
        "grouped_mm",
        (("B_NK", 1),),
        8,
        "the fp32 forward on sm_90 (IEEE fp32 dot, weights read [N, K]-major): ptxas stores one 8-byte value to "
        "the stack (measured 8 B; 16-bit operands, how MoE models train, do not spill)",
    ),
)


def accepted_spill(result: CompileResult) -> AcceptedSpill | None:
    """The AcceptedSpill covering `result`'s spill, or None (no spill needs none; an unnamed one fails)."""
    return next((accepted for accepted in ACCEPTED_SPILLS if accepted.covers(result)), None)


def _compile_or_error(job: tuple[KernelConfig, int]) -> CompileResult | str:
    config, arch = job
    try:
        return compile_for(config, arch)
    except Exception as err:  # a compile error is the result to report, whatever Triton raised
        return f"sm_{arch} {config.label()}: {type(err).__name__}: {err}"


def compile_all(configs: list[KernelConfig], archs: list[int], workers: int = 2) -> list[CompileResult | str]:
    """compile_for over configs x archs (arch by arch): see compile_jobs."""
    return compile_jobs([(config, arch) for arch in archs for config in configs], workers)


def compile_jobs(jobs: list[tuple[KernelConfig, int]], workers: int = 2) -> list[CompileResult | str]:
    """compile_for of each (config, arch) in `workers` fresh (spawned) processes with Triton's interpreter off,
    whatever this process runs under; an error comes back as its message. No job: no process started."""
    if not jobs:
        return []
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"  # the workers inherit the environment as they start
    try:
        pool = multiprocessing.get_context("spawn").Pool(max(1, min(workers, len(jobs))))
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    with pool:
        return pool.map(_compile_or_error, jobs, chunksize=4)
