"""Cluster specs: one GPU kind, nodes of `gpus_per_node`, NVLink inside a node and InfiniBand between nodes,
plus the efficiency constants the cost model uses (calibrated, see planner/calibrate.py).

An optional `storage` section gives the shared file system's read and write bandwidth for checkpoints.
A spec is a YAML file (configs/clusters/*.yaml) read strictly: an unknown or missing key is an error that
names the file and the key. Bandwidths are in GB/s (10^9 bytes), peak in TFLOP/s (10^12), memory in GiB.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

import yaml

from config.yaml_reader import read_yaml_file


class ClusterError(ValueError):
    """A bad cluster spec: the message names the file and the key."""


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of the hardware peaks; what `--calibrate` fits.

    GEMM efficiency of a matrix multiply of F FLOPs over R rows (tokens of the micro-batch):
    gemm_max * F / (F + gemm_half_flops) * R / (R + gemm_half_rows): a fixed per-kernel cost on top of a peak
    rate (small GEMMs, from a small hidden size or a large tp, run below peak), and short row counts (small
    micro-batches) filling the GPU's tiles less well.
    Memory-bound kernels (norms, dropout, GeLU, softmax, the optimizer) move bytes at hbm * HBM bandwidth;
    collectives and sends reach nvlink / network of the link bandwidth plus NCCL's latency model: a fixed
    `collective_base_us` per call and, per ring step, `latency_us` for the steps crossing a node boundary and
    `nvlink_latency_us` for the others (on a CPU node, shared memory; gloo on a loaded CPU pays per call).
    `competing_processes` (CPU nodes only): other busy processes the scheduler shares the cores with.
    `attention`: "materialized" (softmax over the [s, s] scores in HBM, as Megatron-LM 2021) or "flash"
    (a fused kernel keeps no [s, s] tensor; the trainer's scaled_dot_product_attention on GPU).
    """

    gemm_max: float = 0.75
    gemm_half_flops: float = 2.0e9
    gemm_half_rows: float = 0.0
    hbm: float = 0.7
    nvlink: float = 0.75
    network: float = 0.8
    latency_us: float = 10.0  # NCCL's tuning table: ~9.6 us per ring step over the network (Simple protocol)
    nvlink_latency_us: float = 3.4  # and 3.4 us per step over NVLink
    collective_base_us: float = 8.4  # and 8.4 us per call (its base latency)
    competing_processes: float = 0.0  # CPU nodes: other busy processes sharing node.cores (a shared machine)
    attention: str = "materialized"

    def validate(self, where: str) -> None:
        numbers = (
            "gemm_max",
            "gemm_half_flops",
            "gemm_half_rows",
            "hbm",
            "nvlink",
            "network",
            "latency_us",
            "nvlink_latency_us",
            "collective_base_us",
        )
        for key in (*numbers, "competing_processes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ClusterError(f"{where}: efficiency.{key}={value!r} must be a number (write 2.5e+10, not 2.5e10)")
        for key in ("gemm_max", "hbm", "nvlink", "network"):
            value = getattr(self, key)
            if not 0.0 < value <= 1.0:
                raise ClusterError(f"{where}: efficiency.{key}={value} must be in (0, 1]")
        lows = (
            self.gemm_half_flops,
            self.gemm_half_rows,
            self.latency_us,
            self.nvlink_latency_us,
            self.collective_base_us,
        )
        if min(*lows, self.competing_processes) < 0:
            raise ClusterError(f"{where}: efficiency.gemm_half_flops, gemm_half_rows and the latencies must be >= 0")
        if self.attention not in ("materialized", "flash"):
            raise ClusterError(f"{where}: efficiency.attention={self.attention!r} is not materialized or flash")


@dataclass(frozen=True)
class ClusterSpec:
    """One homogeneous cluster: per-GPU peaks, node size and links (per GPU, one direction)."""

    name: str
    peak_tflops: float  # dense 16-bit tensor-core peak per GPU (fp32 runs use peak_tflops_fp32)
    peak_tflops_fp32: float
    memory_gib: float
    hbm_gbs: float
    gpus_per_node: int
    nvlink_gbs: float  # NVLink per GPU, both directions together (as vendors quote it)
    network_gbs_per_gpu: float  # inter-node bandwidth per GPU, one direction (8 x 200 Gb/s per 8 GPUs = 25)
    memory_allowance_gib: float = 3.0  # CUDA context, NCCL buffers, cuBLAS workspace
    # the caching allocator's fragmentation (and saved tensors Korthikanti's count misses), as a fraction of
    # the kept activations: it grows with them, so a fixed allowance cannot hold it (Figure 17, see memory.py)
    activation_overhead: float = 0.0
    cores_per_node: float = 0.0  # CPU nodes: cores the node's single-threaded ranks share (0: one device per rank)
    efficiency: Efficiency = field(default_factory=Efficiency)
    calibration: str = ""  # where the efficiency constants come from
    # the shared file system as a checkpoint reaches it, GB/s over all nodes (None: the file has no storage section)
    storage_read_gbs: float | None = None
    storage_write_gbs: float | None = None

    @property
    def nvlink_one_way_gbs(self) -> float:
        return self.nvlink_gbs / 2.0

    def with_efficiency(self, **changes: Any) -> ClusterSpec:
        """The same cluster with some efficiency constants replaced."""
        return dataclasses.replace(self, efficiency=dataclasses.replace(self.efficiency, **changes))


def _strict(section: dict, known: list[str], where: str, prefix: str) -> None:
    for key in section:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known keys: {', '.join(known)}"
            raise ClusterError(f"{where}: unknown key {prefix}{key}{hint}")


def _number(section: dict, key: str, where: str, prefix: str) -> float:
    if key not in section:
        raise ClusterError(f"{where}: missing key {prefix}{key}")
    value = section[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ClusterError(f"{where}: {prefix}{key}={value!r} must be a positive number")
    return float(value)


def cluster_from_dict(raw: dict, where: str = "cluster spec") -> ClusterSpec:
    """Build a ClusterSpec from the YAML layout (name, gpu, node, network, efficiency, calibration)."""
    if not isinstance(raw, dict):
        raise ClusterError(f"{where} must hold a mapping")
    _strict(raw, ["name", "gpu", "node", "network", "storage", "efficiency", "calibration"], where, "")
    sections: dict[str, dict] = {}
    for name in ("gpu", "node", "network"):
        section = raw.get(name)
        if not isinstance(section, dict):
            raise ClusterError(f"{where}: section {name} is missing or not a mapping")
        sections[name] = section
    gpu, node, network = sections["gpu"], sections["node"], sections["network"]
    _strict(gpu, ["model", "peak_tflops_bf16", "peak_tflops_fp32", "memory_gib", "hbm_gbs"], where, "gpu.")
    _strict(node, ["gpus", "nvlink_gbs", "memory_allowance_gib", "activation_overhead", "cores"], where, "node.")
    _strict(network, ["links_per_node", "link_gbps"], where, "network.")
    gpus = node.get("gpus")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ClusterError(f"{where}: node.gpus={gpus!r} must be a positive integer")
    network_gbs = (
        _number(network, "links_per_node", where, "network.")
        * _number(network, "link_gbps", where, "network.")
        / 8.0
        / gpus
    )
    storage = raw.get("storage")
    if storage is not None and not isinstance(storage, dict):
        raise ClusterError(f"{where}: section storage is not a mapping")
    if storage is not None:
        _strict(storage, ["read_gbs", "write_gbs"], where, "storage.")
    eff_raw = raw.get("efficiency") or {}
    known = [f.name for f in dataclasses.fields(Efficiency)]
    _strict(eff_raw, known, where, "efficiency.")
    efficiency = Efficiency(**eff_raw)
    efficiency.validate(where)
    return ClusterSpec(
        name=str(raw.get("name", where)),
        peak_tflops=_number(gpu, "peak_tflops_bf16", where, "gpu."),
        peak_tflops_fp32=_number(gpu, "peak_tflops_fp32", where, "gpu."),
        memory_gib=_number(gpu, "memory_gib", where, "gpu."),
        hbm_gbs=_number(gpu, "hbm_gbs", where, "gpu."),
        gpus_per_node=gpus,
        nvlink_gbs=_number(node, "nvlink_gbs", where, "node."),
        network_gbs_per_gpu=network_gbs,
        memory_allowance_gib=float(node.get("memory_allowance_gib", 3.0)),
        activation_overhead=float(node.get("activation_overhead", 0.0)),
        cores_per_node=float(node.get("cores", 0)),
        efficiency=efficiency,
        calibration=str(raw.get("calibration", "")),
        storage_read_gbs=_number(storage, "read_gbs", where, "storage.") if storage is not None else None,
        storage_write_gbs=_number(storage, "write_gbs", where, "storage.") if storage is not None else None,
    )


def load_cluster(path: str) -> ClusterSpec:
    """Read and check a cluster YAML file."""
    raw = read_yaml_file(path, "cluster", ClusterError)
    try:
        return cluster_from_dict(raw, path)
    except TypeError as err:  # a wrong value type inside efficiency
        raise ClusterError(f"{path}: {err}") from None


def efficiency_yaml(efficiency: Efficiency) -> str:
    """The `efficiency:` section of a cluster file holding these constants."""
    return yaml.safe_dump({"efficiency": dataclasses.asdict(efficiency)}, sort_keys=False)
