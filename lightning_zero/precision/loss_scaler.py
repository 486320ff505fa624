"""A pure dynamic loss scaler with DeepSpeed's semantics and defaults.

No tensors and no collectives: the caller decides whether the step overflowed (on every
rank, after the cross-rank vote) and calls :meth:`update` once per iteration (after the steps that followed a backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DynamicLossScaler", "LossScaleAtMinimumError", "STATIC_OVERFLOW_LIMIT"]

STATIC_OVERFLOW_LIMIT = 10  # consecutive skipped steps after which a static scale is an error


class LossScaleAtMinimumError(RuntimeError):
    """Gradients overflowed while the loss scale was already at its minimum."""


@dataclass
class DynamicLossScaler:
    """Loss scale that halves on overflow and doubles after a window of clean steps.

    Args:
        init_scale: starting scale (DeepSpeed: 2**initial_scale_power, default 2**16).
        scale_window: clean steps since the last overflow after which the scale doubles.
        hysteresis: overflows absorbed before the scale is halved; restored when the scale grows.
        consecutive_hysteresis: restored after every step without overflow instead (only consecutive
            overflows halve the scale), as DeepSpeed's option of that name.
        min_scale: floor of the scale; an overflow that would need to go below it raises.
        scale_factor: multiplier for growth and shrink.
        dynamic: False keeps ``init_scale`` forever (a static scale: overflow steps are skipped).
    """

    init_scale: float = 2.0**16
    scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    scale_factor: float = 2.0
    dynamic: bool = True

    def __post_init__(self) -> None:
        if self.hysteresis < 1 or self.scale_window < 1 or self.min_scale <= 0 or self.scale_factor <= 1:
            raise ValueError(f"invalid loss scaler settings: {self}")
        self.scale = float(self.init_scale)
        self.cur_hysteresis = self.hysteresis
        self.step_count = 0  # optimizer steps seen (skipped ones included)
        self.last_overflow_step = -1
        self.overflows = 0
        self.consecutive_overflows = 0

    @property
    def fails_on_overflow(self) -> bool:
        """An overflow now would raise :class:`LossScaleAtMinimumError` in :meth:`update`."""
        return self.dynamic and self.cur_hysteresis <= 1 and self.scale <= self.min_scale

    def update(self, overflow: bool) -> None:
        """Account for one step; ``overflow`` means non-finite gradients on some rank."""
        if overflow:
            self.overflows += 1
            self.consecutive_overflows += 1
            if not self.dynamic and self.consecutive_overflows >= STATIC_OVERFLOW_LIMIT:
                # a static scale never comes down: every later step would be skipped too, without a word
                raise LossScaleAtMinimumError(
                    f"the static loss scale {self.scale:g} overflowed the fp16 gradients in {self.consecutive_overflows} "
                    f"consecutive steps, so none of them was applied. Use dynamic loss scaling (loss_scale=0, "
                    f"DeepSpeed's fp16.loss_scale 0) or a smaller static scale.")
            if self.dynamic:
                if self.cur_hysteresis > 1:
                    self.cur_hysteresis -= 1
                elif self.scale <= self.min_scale:
                    raise LossScaleAtMinimumError(
                        f"loss scale is at its minimum ({self.min_scale:g}) and gradients still overflow"
                    )
                else:
                    self.scale = max(self.scale / self.scale_factor, self.min_scale)
            self.last_overflow_step = self.step_count
        else:
            self.consecutive_overflows = 0
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if self.dynamic and (self.step_count - self.last_overflow_step) % self.scale_window == 0:
                self.scale *= self.scale_factor
                self.cur_hysteresis = self.hysteresis
        self.step_count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "cur_hysteresis": self.cur_hysteresis, "step_count": self.step_count,
                "last_overflow_step": self.last_overflow_step, "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.step_count = int(state["step_count"])
        self.last_overflow_step = int(state["last_overflow_step"])
        self.overflows = int(state.get("overflows", 0))
