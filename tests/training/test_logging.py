"""training/logging.py: the two throughput figures and the peak MFU divides by."""

from types import SimpleNamespace

import pytest

from model.shape import IterationFlops
from training.logging import IntervalStats, format_train_line, peak_tflops

pytestmark = pytest.mark.tier("fast")


def test_peak_comes_from_the_config_or_the_device_name():
    assert peak_tflops(400.0, "cpu", "bf16") == 400.0  # logging.peak_tflops wins
    assert peak_tflops(None, "cpu", "bf16") is None
    assert peak_tflops(None, "cuda", "bf16", "NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops(None, "cuda", "bf16", "NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops(None, "cuda", "fp16", "NVIDIA H100 PCIe") == 756.0
    assert peak_tflops(None, "cuda", "bf16", "NVIDIA H200") == 989.0
    assert peak_tflops(None, "cuda", "fp32", "NVIDIA H200") is None  # a 16-bit peak says nothing of fp32
    assert peak_tflops(None, "cuda", "bf16", "Some Future GPU") is None


def interval(peak):
    stats = IntervalStats(IterationFlops(model=3e12, with_recompute=4e12), 1024, 2, "cpu", peak)
    for _ in range(2):
        stats.add(SimpleNamespace(loss=2.0, skipped=False, grad_norm=1.0, loss_scale=1.0, moe={}), lr=0.1, seconds=0.5)
    return stats.flush(SimpleNamespace(iteration=2, consumed_samples=8, skipped_iters=0))


def test_both_figures_are_logged_and_labelled():
    record = interval(peak=10.0)
    assert record["tflops_per_device"] == pytest.approx(4.0)  # 4e12 per 0.5 s on 2 devices
    assert record["model_tflops_per_device"] == pytest.approx(3.0) and record["mfu"] == pytest.approx(0.3)
    line = format_train_line({**record, "lr": 0.1, "grad_norm": 1.0}, 10)
    assert "4.000 TFLOP/s/dev (paper, recompute incl.)" in line and "MFU 30.0%" in line
    no_peak = interval(peak=None)
    assert no_peak["mfu"] is None and "MFU" not in format_train_line(no_peak, 10)
