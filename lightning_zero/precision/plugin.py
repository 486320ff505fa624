"""ZeroPrecision: Lightning's precision plugin for sharded, mixed-precision ZeRO training.

Order of one optimizer step (as Lightning's AMP plugin): scale the loss → closure
(forward + backward) → close the gradient window (reductions done) → unscale and vote on
overflow (one all-reduce MAX) and update the scale → clip (global norm across shards) →
step or skip. Unscaling, the vote and the scale update happen once per window of
backwards, for every optimizer at once: two optimizers stepping after one backward see the
same, unscaled gradients and the same verdict.

Mixed modes ("bf16-mixed", "16-mixed") keep 16-bit parameters and gradients in the module
and run forward under autocast, so user code that mixes in fp32 tensors keeps working.
True modes ("bf16-true", "16-true") run the 16-bit module without autocast. Every mode keeps
fp32 master weights in the optimizer; the loss and the overflow check are fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor

from ..config import ZeroConfig
from .loss_scaler import DynamicLossScaler, LossScaleAtMinimumError

if TYPE_CHECKING:
    from ..engine import ZeroEngine

__all__ = ["ZeroPrecision", "PRECISIONS"]

PRECISIONS = {
    "32-true": torch.float32, "32": torch.float32,
    "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16, "16-true": torch.float16,
}


class ZeroPrecision(Precision):
    """Precision plugin of :class:`lightning_zero.ZeroStrategy`.

    Args:
        precision: one of "32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true".
            Pass it explicitly (``plugins=[ZeroPrecision("16-mixed")]``) to get real fp16 with
            loss scaling on CPU, where Lightning turns the string "16-mixed" into bf16.
        config: loss-scaling settings (``loss_scale``, ``initial_scale_power``, ...); the
            strategy passes its own config when none is given here.
    """

    def __init__(self, precision: str = "32-true", config: Optional[ZeroConfig] = None) -> None:
        precision = str(precision)
        if precision not in PRECISIONS:
            raise ValueError(f"ZeroPrecision(precision={precision!r}) is not supported: use one of "
                             f"{', '.join(p for p in PRECISIONS if p != '32')}.")
        self.precision = "32-true" if precision == "32" else precision
        self.compute_dtype = PRECISIONS[precision]
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.scaler: Optional[DynamicLossScaler] = None
        self._engine: Optional[ZeroEngine] = None
        self._unscaled_window = -1  # the engine window whose gradients were unscaled (see _unscale_window)
        self._window_overflow = False
        self.configure(config, explicit=config is not None)

    @property
    def mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    def configure(self, config: Optional[ZeroConfig], explicit: bool = True) -> None:
        """(Re)build the loss scaler from ``config``; fp16 modes only."""
        self._config_explicit = explicit
        if self.compute_dtype != torch.float16:
            return
        config = config or ZeroConfig()
        static = config.loss_scale > 0
        self.scaler = DynamicLossScaler(
            init_scale=config.loss_scale if static else 2.0**config.initial_scale_power,
            scale_window=config.loss_scale_window, hysteresis=config.hysteresis,
            min_scale=config.min_loss_scale, dynamic=not static)

    def attach(self, engine: ZeroEngine, device_type: str) -> None:
        self._engine = engine
        self.device_type = device_type

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    # ---- forward ------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.mixed:
            with torch.autocast(self.device_type, dtype=self.compute_dtype):
                yield
        elif self.compute_dtype != torch.float32:
            default = torch.get_default_dtype()
            torch.set_default_dtype(self.compute_dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(default)
        else:
            yield

    def convert_input(self, data: Any) -> Any:
        if self.mixed or self.compute_dtype == torch.float32:
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t)

    # ---- backward and step ------------------------------------------------------------------
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        if self.scaler is not None:
            tensor = tensor.float() * self.scaler.scale
        return super().pre_backward(tensor, module)

    def zero_optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """The whole step for one optimizer (see the module docstring for the order)."""
        engine = self._require_engine()
        closure_result = closure()
        skipped_backward = closure_result is None and getattr(model, "automatic_optimization", False)
        overflow = False if skipped_backward else self._unscale_window(engine)
        self._after_closure(model, optimizer)
        if skipped_backward:
            return closure_result
        if overflow:
            engine.skip_step(optimizer)
            return closure_result
        output = engine.step(optimizer, **kwargs)
        return output if output is not None else closure_result

    def _unscale_window(self, engine: ZeroEngine) -> bool:
        """Unscale every gradient of the window, vote on overflow and update the scale: once per
        window, whichever optimizer asks first; later optimizers of the window reuse the verdict."""
        engine.finish_grads()
        if self.scaler is None:
            return False
        if self._unscaled_window == engine.window:
            return self._window_overflow
        overflow = engine.unscale_and_check_(1.0 / self.scaler.scale, check=True)
        self._unscaled_window, self._window_overflow = engine.window, overflow
        try:
            self.scaler.update(overflow)
        except LossScaleAtMinimumError as err:
            names = engine.nonfinite_parameters()
            shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
            raise LossScaleAtMinimumError(
                f"fp16 gradients still overflow with the loss scale at its minimum ({self.scaler.min_scale:g}); "
                f"non-finite gradients in: {shown or 'no parameter (the loss itself is not finite)'}. "
                f"The model produces values fp16 cannot hold: train with precision='bf16-mixed' (same speed "
                f"on recent GPUs, no loss scaling needed), lower the learning rate, or check those layers "
                f"for exploding activations.") from err
        return overflow

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        engine = self._require_engine()
        self._unscale_window(engine)  # as torch's AMP: clipping always sees unscaled gradients
        engine.clip_grad_norm_(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        engine = self._require_engine()
        self._unscale_window(engine)
        engine.clip_grad_value_(optimizer, clip_val)

    def _require_engine(self) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError("ZeroPrecision is used without a ZeroStrategy: pass it to Trainer together with "
                               "strategy='zero1'/'zero2'/'zero3'.")
        return self._engine

    # ---- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])
