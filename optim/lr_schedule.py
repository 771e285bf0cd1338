"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to min_lr (Megatron's rules).

Warmup follows Megatron-LM's OptimizerParamScheduler exactly: for iteration <= warmup_iters,
lr = max_lr * iteration / warmup_iters, so iteration 0 (the first step) runs at lr 0 and iteration
warmup_iters reaches max_lr. We keep Megatron's choice so that runs compare step for step with it; the first
step still warms the Adam moments. After warmup the decay ratio runs from 0 at warmup_iters to 1 at
decay_iters; past decay_iters the lr stays at min_lr ("constant" stays at max_lr).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from config.schema import LR_DECAY_STYLES, OptimConfig


class LRSchedule:
    """lr(iteration) for a 0-based count of optimizer steps taken so far.

    Args:
        max_lr: the peak learning rate, reached at the end of warmup.
        min_lr: the floor of the decay.
        warmup_iters: number of warmup iterations (0: none).
        decay_iters: iteration at which the decay reaches min_lr (counted from 0, warmup included).
        decay_style: "cosine", "linear" or "constant".
    """

    def __init__(self, max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int, decay_style: str):
        self._set(max_lr, min_lr, warmup_iters, decay_iters, decay_style)

    @classmethod
    def of(cls, optim: OptimConfig, train_iters: int) -> LRSchedule:
        """The schedule of the optim section; the decay ends at optim.lr_decay_iters, else at train.train_iters."""
        decay_iters = optim.lr_decay_iters or train_iters
        return cls(optim.lr, optim.min_lr, optim.lr_warmup_iters, decay_iters, optim.lr_decay_style)

    def _set(self, max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int, decay_style: str) -> None:
        """Check and take the settings (the constructor, and a checkpoint's settings on load)."""
        if decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"decay_style={decay_style!r} is not one of {', '.join(LR_DECAY_STYLES)}")
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"min_lr={min_lr} and max_lr={max_lr} need 0 <= min_lr <= max_lr")
        if warmup_iters < 0 or decay_iters < warmup_iters:
            raise ValueError(
                f"warmup_iters={warmup_iters} and decay_iters={decay_iters} need 0 <= warmup_iters <= decay_iters"
            )
        self.max_lr, self.min_lr = float(max_lr), float(min_lr)
        self.warmup_iters, self.decay_iters = int(warmup_iters), int(decay_iters)
        self.decay_style = decay_style

    def lr(self, iteration: int) -> float:
        """The learning rate of optimizer step number `iteration` (0-based)."""
        if self.warmup_iters > 0 and iteration <= self.warmup_iters:
            return self.max_lr * iteration / self.warmup_iters
        if self.decay_style == "constant":
            return self.max_lr
        if iteration >= self.decay_iters:
            return self.min_lr
        ratio = (iteration - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.decay_style == "cosine":
            coefficient = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coefficient = 1.0 - ratio
        return self.min_lr + coefficient * (self.max_lr - self.min_lr)

    def state_dict(self) -> dict[str, float | str]:
        """The schedule's settings (numbers and a string: torch.load(weights_only=True)-safe)."""
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_iters": self.warmup_iters,
            "decay_iters": self.decay_iters,
            "decay_style": self.decay_style,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> list[str]:  # decoded from meta.json
        """Take the checkpoint's settings; returns "key: checkpoint != current" lines for the ones that
        differed (for the caller to log), empty when they agreed."""
        changed = [
            f"{key}: {state[key]!r} != {getattr(self, key)!r}"
            for key in self.state_dict()
            if key in state and state[key] != getattr(self, key)
        ]
        self._set(**{key: state.get(key, value) for key, value in self.state_dict().items()})
        return changed
