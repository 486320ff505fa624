"""One optimizer step for both front ends (the Lightning plugin and the DeepSpeed-style engine API).

[Note: loss scaling]
fp16 gradients are produced scaled by the loss scale ``S`` and stored unscaled: each reduced
chunk is multiplied by ``1/S`` as it is added to the fp32 gradient shard (after the sum, so
small gradients never underflow in 16 bits). A gradient kept across steps (DDP semantics:
until ``zero_grad``) therefore never mixes scales, and clipping, hooks and the step always see
true values. The overflow vote is per optimizer, as torch's ``GradScaler``: a step is skipped
when that optimizer's gradients hold inf/nan on any rank (one all-reduce). The scale is updated
once after the steps that followed a backward, before the next backward scales its loss (the
OR of those steps' verdicts), so every gradient of one backward is unscaled with the scale its
loss was multiplied by, however many optimizers step on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..config import ZeroConfig
from .loss_scaler import DynamicLossScaler, LossScaleAtMinimumError

if TYPE_CHECKING:
    from ..engine import ZeroEngine

__all__ = ["make_scaler", "LossScaling", "zero_step"]


def make_scaler(config: Optional[ZeroConfig], compute_dtype: torch.dtype) -> Optional[DynamicLossScaler]:
    """The loss scaler fp16 compute needs (None for fp32 and bf16), from the config's loss-scale fields."""
    if compute_dtype != torch.float16:
        return None
    config = config or ZeroConfig()
    static = config.loss_scale > 0
    return DynamicLossScaler(
        init_scale=config.loss_scale if static else 2.0**config.initial_scale_power,
        scale_window=config.loss_scale_window, hysteresis=config.hysteresis,
        consecutive_hysteresis=config.consecutive_hysteresis, min_scale=config.min_loss_scale, dynamic=not static)


class LossScaling:
    """The scaler's side of a step: scale the loss, vote on overflow, update the scale (see [Note: loss scaling]).

    Args:
        scaler: the dynamic (or static) loss scaler; None: no scaling (fp32, bf16).
    """

    def __init__(self, scaler: Optional[DynamicLossScaler]) -> None:
        self.scaler = scaler
        self._pending: Optional[bool] = None  # OR of the verdicts since the last update; None: no step since
        self.skipped = 0  # steps skipped for overflow (diagnostics, the engine API's ``skipped_steps``)

    @property
    def scale(self) -> float:
        self.flush()
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor, engine: Optional[ZeroEngine]) -> torch.Tensor:
        """The loss to back-propagate; tells the engine what its gradients will be scaled by."""
        if self.scaler is None:
            return loss
        scale = self.scale
        if engine is not None:
            engine.set_grad_scale(scale)
        return loss.float() * scale

    def vote(self, engine: ZeroEngine, optimizer: Any) -> bool:
        """Close the window; True if ``optimizer``'s gradients overflowed on any rank (then its step is skipped)."""
        engine.finish_grads()
        if self.scaler is None:
            return False
        overflow = engine.grads_nonfinite(optimizer)
        self._pending = overflow or bool(self._pending)
        if overflow:
            self.skipped += 1
            if self.scaler.fails_on_overflow:
                self._raise_at_minimum(engine)
        return overflow

    def flush(self) -> None:
        """Apply the verdicts of the steps since the last update (before the next backward scales its loss)."""
        if self.scaler is not None and self._pending is not None:
            overflow, self._pending = self._pending, None
            self.scaler.update(overflow)

    def _raise_at_minimum(self, engine: ZeroEngine) -> None:
        names = engine.nonfinite_parameters()
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        raise LossScaleAtMinimumError(
            f"fp16 gradients still overflow with the loss scale at its minimum ({self.scaler.min_scale:g}); "
            f"non-finite gradients in: {shown or 'no parameter (the loss itself is not finite)'}. "
            f"The model produces values fp16 cannot hold: train with precision='bf16-mixed' (same speed "
            f"on recent GPUs, no loss scaling needed), lower the learning rate, or check those layers "
            f"for exploding activations.")

    def state_dict(self) -> dict[str, Any]:
        self.flush()
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("loss_scaler"):
            self._pending = None
            self.scaler.load_state_dict(state["loss_scaler"])


def zero_step(engine: ZeroEngine, optimizer: Any, scaling: LossScaling,
              before_step: Callable[[], None] = lambda: None, **kwargs: Any) -> tuple[bool, Any]:
    """Vote on overflow → ``before_step`` (hooks, clipping: true gradients) → step or skip.

    Returns ``(stepped, what the optimizer's step returned)``; a skipped step changes no value
    and no optimizer state (and the caller must not step an LR scheduler for it).
    """
    overflow = scaling.vote(engine, optimizer)
    before_step()
    if overflow:
        engine.skip_step(optimizer)
        return False, None
    return True, engine.step(optimizer, **kwargs)
