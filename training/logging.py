"""Run logging: the per-interval console line, TensorBoard, metrics.jsonl and (optional) Weights & Biases; the
rank-aware console logger itself is operations/log.py (operations/ logs too and never imports training/)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from checkpoint import describe_write_error
from compat.optional import tensorboard_writer
from model.shape import IterationFlops
from operations.log import get_logger

try:
    import resource  # POSIX only: without it peak_memory_gib reports 0 on CPU
except ImportError:
    resource = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from checkpoint import TrainingProgress
    from training.train_step import StepResult
    from training.wandb_logging import WandbSink

# Dense 16-bit (bf16/fp16) tensor-core peaks per GPU in TFLOP/s, no sparsity (vendors' data sheets), by a
# substring of the CUDA device name, most specific first ("NVIDIA H100 80GB HBM3" is the SXM part).
DENSE_16BIT_PEAK_TFLOPS = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 SXM", 989.0),
    ("H100 80GB HBM3", 989.0),
    ("H100 NVL", 835.0),
    ("H100", 756.0),  # PCIe
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("RTX 4090", 165.0),
    ("A10G", 70.0),
    ("L4", 121.0),
    ("V100", 125.0),  # fp16 (no bf16)
)


class MetricsWriteError(OSError):
    """metrics.jsonl could not be written (a full disk, a read-only run.dir): one line naming the file."""


class MetricsWriter:
    """Writes scalars to run_dir/metrics.jsonl (one JSON object per logged iteration), TensorBoard and, when
    given one, a W&B run (training.wandb_logging).

    Only the logging rank constructs one with enabled=True; other ranks get a writer that does nothing.
    """

    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool = True, wandb: WandbSink | None = None):
        self.enabled = enabled
        self.wandb = wandb
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tensorboard_dir = os.path.join(run_dir, "tensorboard")
        self._tb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if tensorboard:
            try:
                summary_writer = tensorboard_writer()
            except ImportError:  # tensorboard is in requirements.txt; keep training if it is missing
                get_logger().warning("tensorboard is not installed: TensorBoard events are not written")
            else:
                self._tb = summary_writer(log_dir=self.tensorboard_dir)

    def _read_lines(self) -> list[str]:
        """The file's complete lines; a torn last line (a crash or a full disk mid-write) is dropped with a
        warning naming the file. A malformed line elsewhere is an error naming the file and line."""
        with open(self.path, encoding="utf-8", errors="replace") as handle:
            lines = handle.readlines()
        kept = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as err:
                if number == len(lines):
                    get_logger().warning(
                        f"warning: dropped the torn last line {number} of {self.path} "
                        f"({len(line)} bytes, not complete JSON)"
                    )
                    continue
                raise ValueError(f"{self.path}:{number}: malformed JSON ({err.msg})") from None
            kept.append(line if line.endswith("\n") else line + "\n")
        return kept

    def truncate_after(self, iteration: int) -> None:
        """On resume: drop lines of iterations after the checkpoint (and a torn last line) so the file reads
        as one run."""
        if not self.enabled or not os.path.exists(self.path):
            return
        kept = [line for line in self._read_lines() if json.loads(line).get("iteration", 0) <= iteration]
        with open(self.path + ".tmp", "w", encoding="utf-8") as handle:
            handle.writelines(kept)
        os.replace(self.path + ".tmp", self.path)

    def set_aside(self) -> str | None:
        """A run starting from iteration 0 in a run.dir that already has metrics: move the old file to
        metrics.jsonl.N (first free N) instead of appending a second copy of the iterations. Returns the
        new name, or None when there was nothing to move."""
        if not self.enabled or not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            return None
        number = 1
        while os.path.exists(f"{self.path}.{number}"):
            number += 1
        os.replace(self.path, f"{self.path}.{number}")
        return f"{self.path}.{number}"

    def write(self, record: Mapping[str, object]) -> None:
        """Append one record as one complete line (a single write to an O_APPEND file); non-finite numbers
        become null and are listed under "nonfinite", so the file stays JSON."""
        if not self.enabled:
            return
        line = (json.dumps(json_safe(record), allow_nan=False) + "\n").encode("utf-8")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, line)
                if written != len(line):  # a full disk: say so instead of leaving half a line unnoticed
                    raise OSError(f"short write ({written} of {len(line)} bytes)")
            finally:
                os.close(fd)
        except OSError as err:
            raise MetricsWriteError(
                f"cannot write {self.path} at iteration {record.get('iteration')}: "
                f"{describe_write_error(err, os.path.dirname(self.path), len(line))}"
            ) from None
        if self._tb is not None:
            step = record["iteration"]
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self.wandb is not None:
            self.wandb.log(record)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None


def json_safe(record: Mapping[str, object]) -> Mapping[str, object]:
    """`record` with nan/inf floats as None and their keys listed under "nonfinite" (JSON has no NaN)."""
    bad = [key for key, value in record.items() if isinstance(value, float) and not math.isfinite(value)]
    if not bad:
        return record
    return {**{key: (None if key in bad else value) for key, value in record.items()}, "nonfinite": bad}


def format_train_line(record: Mapping[str, float | None], train_iters: int) -> str:
    """The console line of one logging interval."""
    parts = [
        f"iter {record['iteration']:>6}/{train_iters}",
        f"samples {record['consumed_samples']}",
        f"loss {record['lm_loss']:.4f}",
        f"lr {record['lr']:.3e}",
        f"grad norm {record['grad_norm']:.3f}",
        f"{record['ms_per_iter']:.1f} ms/it",
        f"{record['tokens_per_sec']:.0f} tok/s",
        f"{record['tflops_per_device']:.3f} TFLOP/s/dev (paper, recompute incl.)",
    ]
    mfu = record.get("mfu")
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    parts.append(f"mem {record['memory_gib']:.2f} GiB")
    if record.get("loss_scale", 1.0) != 1.0 or record.get("skipped_iters"):
        parts.append(f"loss scale {record['loss_scale']:.0f}")
    if record.get("skipped_iters"):
        parts.append(f"skipped {record['skipped_iters']} (total {record.get('skipped_total', '?')})")
    if "moe_max_load" in record:
        parts.append(
            f"moe aux {record['moe_load_balancing_loss']:.4g} z {record['moe_z_loss']:.4g} "
            f"max load {record['moe_max_load']:.2f}x dropped {100 * (record['moe_dropped_fraction'] or 0.0):.1f}%"
        )
    return " | ".join(parts)


def peak_memory_gib(device_type: str) -> float:
    """Peak memory of this process: allocator peak on GPU, resident-set high-water mark on CPU."""
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    if resource is None:
        return 0.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def peak_tflops(
    configured: float | None, device_type: str, precision: str, device_name: str | None = None
) -> float | None:
    """The peak MFU divides by: logging.peak_tflops when set, else the known dense 16-bit peak of the CUDA
    device (`device_name`, default: the current one) for bf16/fp16 runs; None (no MFU) on CPU, for fp32 runs
    and for a GPU not in DENSE_16BIT_PEAK_TFLOPS."""
    if configured is not None:
        return configured
    if device_type != "cuda" or precision == "fp32":
        return None
    if device_name is None:
        device_name = torch.cuda.get_device_name()
    return next((peak for name, peak in DENSE_16BIT_PEAK_TFLOPS if name in device_name), None)


class IntervalStats:
    """Accumulates the iterations between two console lines and turns them into one metrics record.

    Two throughput figures, labelled: `tflops_per_device`, the paper's achieved TFLOP/s (the forward that
    recomputation repeats included, its equation 3), and `model_tflops_per_device` with `mfu`, model FLOPs
    only (recomputation excluded) over the device's peak, as PaLM defines MFU (None without a peak).
    """

    def __init__(
        self,
        flops: IterationFlops,
        tokens_per_iter: int,
        world_size: int,
        device_type: str,
        peak_tflops: float | None = None,
    ):
        self.flops, self.tokens_per_iter, self.peak_tflops = flops, tokens_per_iter, peak_tflops
        self.world_size, self.device_type = world_size, device_type
        self._reset()

    def _reset(self) -> None:
        self.iters = self.counted = self.skipped = 0
        self.loss_sum = self.all_loss_sum = self.seconds = 0.0
        self.last: dict[str, float] = {}
        self.moe_sums: dict[str, float] = {}  # the MoE routing metrics summed over the interval's iterations

    def add(self, result: StepResult, lr: float, seconds: float) -> None:
        """One finished iteration (a training.train_step.StepResult); skipped steps do not count in the loss."""
        self.iters += 1
        self.seconds += seconds
        self.all_loss_sum += result.loss
        if result.skipped:
            self.skipped += 1
        else:
            self.counted += 1
            self.loss_sum += result.loss
        self.last = {"lr": lr, "grad_norm": result.grad_norm, "loss_scale": result.loss_scale}
        for name, value in result.moe.items():
            self.moe_sums[name] = self.moe_sums.get(name, 0.0) + value

    def flush(self, progress: TrainingProgress) -> dict[str, float | None]:
        seconds_per_iter = self.seconds / max(self.iters, 1)
        model_tflops = self.flops.model / seconds_per_iter / self.world_size / 1e12
        record = {
            "iteration": progress.iteration,
            "consumed_samples": progress.consumed_samples,
            # The loss of the applied steps; with none applied (every step skipped), of all of them.
            "lm_loss": self.loss_sum / self.counted if self.counted else self.all_loss_sum / max(self.iters, 1),
            **self.last,
            "ms_per_iter": 1000.0 * seconds_per_iter,
            "tokens_per_sec": self.tokens_per_iter / seconds_per_iter,
            "tflops_per_device": self.flops.with_recompute / seconds_per_iter / self.world_size / 1e12,
            "model_tflops_per_device": model_tflops,
            "mfu": model_tflops / self.peak_tflops if self.peak_tflops else None,
            "memory_gib": peak_memory_gib(self.device_type),
            "world_size": self.world_size,  # what the TFLOP/s divide by (planner/calibrate.py reads it)
            "skipped_iters": self.skipped,
            "skipped_total": progress.skipped_iters,
            # MoE models: the routing metrics (training/moe_step.step_metrics), averaged over the interval
            **{name: total / max(self.iters, 1) for name, total in self.moe_sums.items()},
        }
        self._reset()
        return record
