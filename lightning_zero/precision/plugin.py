"""ZeroPrecision: Lightning's precision plugin for sharded, mixed-precision ZeRO training.

Order of one optimizer step (as Lightning's AMP plugin): scale the loss → closure (forward +
backward; gradients are stored unscaled, see :mod:`lightning_zero.precision.step`) → close
the gradient window and vote on overflow for this optimizer (one all-reduce MAX) → hooks and
clipping (global norm across shards) → step or skip. The scale is updated before the next
backward, from the verdicts of every optimizer that stepped since the last one.

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

from ..config import ZeroConfig, ZeroConfigError
from ..engine.optim import unwrap
from .loss_scaler import DynamicLossScaler
from .step import LossScaling, make_scaler, zero_step

if TYPE_CHECKING:
    from ..engine import ZeroEngine

__all__ = ["ZeroPrecision", "PRECISIONS", "to_zero_precision"]

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
        self.scaling = LossScaling(None)
        self._applied: dict[int, bool] = {}  # id(optimizer) -> its last step was applied (not skipped)
        self._engine: Optional[ZeroEngine] = None
        self.configure(config, explicit=config is not None)

    @property
    def mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    def configure(self, config: Optional[ZeroConfig], explicit: bool = True) -> None:
        """(Re)build the loss scaler from ``config``; fp16 modes only."""
        self._config_explicit = explicit
        self.scaling = LossScaling(make_scaler(config, self.compute_dtype))

    @property
    def scaler(self) -> Optional[DynamicLossScaler]:
        """The loss scaler, with the verdicts of the steps so far applied (None without fp16)."""
        self.scaling.flush()
        return self.scaling.scaler

    def attach(self, engine: Optional[ZeroEngine], device_type: str) -> None:
        self._engine = engine  # None: released (a new engine comes, see ZeroStrategy._release_engine)
        self.device_type = device_type

    @property
    def loss_scale(self) -> float:
        return self.scaling.scale

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
        # another strategy (DDP) never calls zero_optimizer_step: the scaled loss would train unscaled into NaN
        return super().pre_backward(self.scaling.scale_loss(tensor, self._require_engine()), module)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        self._require_engine()  # Lightning's strategies other than ours step through here
        return super().optimizer_step(optimizer, model, closure, **kwargs)

    def zero_optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """The whole step for one optimizer (see the module docstring for the order)."""
        closure_result = closure()
        engine = self._require_engine()  # after the closure: zero_auto may have re-planned in it (replan.py)
        if closure_result is None and getattr(model, "automatic_optimization", False):  # training_step gave no loss
            engine.finish_grads()
            self._after_closure(model, optimizer)
            return closure_result
        applied, output = zero_step(engine, optimizer, self.scaling, lambda: self._after_closure(model, optimizer),
                                    **kwargs)
        self._applied[id(unwrap(optimizer))] = applied
        return output if output is not None else closure_result

    def step_applied(self, optimizer: Any) -> Optional[bool]:
        """Whether ``optimizer``'s last step changed the model (False: skipped for fp16 overflow; None: no step yet)."""
        return self._applied.get(id(unwrap(optimizer)))

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self._require_engine().clip_grad_norm_(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        self._require_engine().clip_grad_value_(optimizer, clip_val)

    def _require_engine(self) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError("ZeroPrecision is used without a ZeroStrategy: pass it to Trainer together with "
                               "strategy='zero1'/'zero2'/'zero3'.")
        return self._engine

    # ---- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.scaling.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaling.load_state_dict(state_dict)


class UnsupportedPrecisionError(ZeroConfigError, TypeError):
    """A precision setting ZeroStrategy does not run (a TypeError as before; a config error for the app's one line)."""


def to_zero_precision(plugin: Precision, config: ZeroConfig) -> ZeroPrecision:
    """Turn Lightning's generic plugin (built from ``precision=``) into ours."""
    if isinstance(plugin, ZeroPrecision):
        if not plugin._config_explicit:
            plugin.configure(config, explicit=False)
        return plugin
    name = str(getattr(plugin, "precision", "32-true"))
    if type(plugin).__name__ not in ("Precision", "MixedPrecision", "HalfPrecision"):
        raise UnsupportedPrecisionError(f"ZeroStrategy cannot run with the precision plugin {type(plugin).__name__} "
                        f"(precision={name!r}); use precision='32-true', 'bf16-mixed', '16-mixed', 'bf16-true' or "
                        f"'16-true', or pass lightning_zero.ZeroPrecision(...) in plugins=[...].")
    return ZeroPrecision(name, config) if name.startswith("16") else ZeroPrecision(name)
