"""LR schedule shapes (Megatron's warmup, cosine / linear / constant decay) and the state round trip."""

import math

import pytest
import torch

from optim.lr_schedule import LRSchedule

pytestmark = pytest.mark.tier("fast")


def test_warmup_is_linear_from_zero():
    schedule = LRSchedule(max_lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110, decay_style="cosine")
    assert schedule.lr(0) == 0.0  # Megatron's convention: iteration 0 runs at lr 0
    assert schedule.lr(5) == pytest.approx(0.5)
    assert schedule.lr(10) == pytest.approx(1.0)


def test_cosine_midpoint_and_end():
    schedule = LRSchedule(max_lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110, decay_style="cosine")
    assert schedule.lr(60) == pytest.approx(0.55)  # halfway: min + (max - min) / 2
    assert schedule.lr(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert schedule.lr(110) == pytest.approx(0.1)
    assert schedule.lr(10_000) == pytest.approx(0.1)
    values = [schedule.lr(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_linear_and_constant():
    linear = LRSchedule(max_lr=2.0, min_lr=0.0, warmup_iters=0, decay_iters=100, decay_style="linear")
    assert linear.lr(0) == pytest.approx(2.0)
    assert linear.lr(25) == pytest.approx(1.5)
    assert linear.lr(100) == 0.0
    constant = LRSchedule(max_lr=2.0, min_lr=0.5, warmup_iters=4, decay_iters=10, decay_style="constant")
    assert constant.lr(2) == pytest.approx(1.0)
    assert constant.lr(4) == constant.lr(7) == constant.lr(1000) == 2.0


def test_invalid_arguments_are_named():
    with pytest.raises(ValueError, match="decay_style"):
        LRSchedule(1.0, 0.1, 0, 10, decay_style="step")
    with pytest.raises(ValueError, match="min_lr"):
        LRSchedule(1.0, 2.0, 0, 10, "cosine")
    with pytest.raises(ValueError, match="warmup_iters"):
        LRSchedule(1.0, 0.1, 20, 10, "cosine")


def test_state_round_trip(tmp_path):
    schedule = LRSchedule(max_lr=3e-4, min_lr=3e-5, warmup_iters=100, decay_iters=1000, decay_style="cosine")
    torch.save(schedule.state_dict(), tmp_path / "lr.pt")
    fresh = LRSchedule(max_lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=1, decay_style="linear")
    changed = fresh.load_state_dict(torch.load(tmp_path / "lr.pt", weights_only=True))
    assert len(changed) == 5 and changed[0].startswith("max_lr")
    assert [fresh.lr(i) for i in range(0, 1200, 37)] == [schedule.lr(i) for i in range(0, 1200, 37)]
    assert fresh.load_state_dict(schedule.state_dict()) == []
