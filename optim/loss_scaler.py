"""Loss scalers of the optimizer (optim/optimizer.py): none for bf16 / fp32, dynamic for fp16."""

from __future__ import annotations

from collections.abc import Mapping

from config.schema import OptimConfig


class ConstantLossScaler:
    """bf16 / fp32: no loss scaling, never skips."""

    dynamic = False
    scale = 1.0

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"scale": 1.0}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        pass


class DynamicLossScaler:
    """fp16 dynamic loss scaling (Megatron's DynamicGradScaler), set by the optim section: start at
    `initial_loss_scale`; after `hysteresis` overflowing steps (counted since the last growth) halve the scale,
    not below `min_loss_scale`; after `loss_scale_window` clean steps in a row double it."""

    dynamic = True

    def __init__(self, optim: OptimConfig):
        self.scale, self.min_scale = float(optim.initial_loss_scale), float(optim.min_loss_scale)
        self.window, self.hysteresis = int(optim.loss_scale_window), int(optim.hysteresis)
        self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Account for one step that did (or did not) overflow."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.window:
            self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict[str, float]:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def loss_scaler_for(precision: str, optim: OptimConfig) -> ConstantLossScaler | DynamicLossScaler:
    """The scaler of train.precision: dynamic (the optim section's settings) for fp16, none otherwise."""
    return DynamicLossScaler(optim) if precision == "fp16" else ConstantLossScaler()
