"""``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` over parameters whose gradients an engine holds.

Between backward and the step each managed parameter's ``.grad`` is None: its gradient lives in the
engine's shards. torch's functions would see no gradient and clip nothing, silently (a manual-
optimization loop's ``clip_grad_norm_(self.parameters(), 1.0)``). While an engine is alive these two
names dispatch the engine's parameters to it (the norm over every rank's pieces, as DDP's gradients
give it) and leave every other tensor to torch, with one total norm over both. A collective when
the engine's parameters are involved: every rank calls it, as every DDP rank does. Code that
imported the function itself before the first engine existed keeps torch's own.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

__all__ = ["install"]

_TORCH: dict[str, Any] = {}  # torch's own functions, once installed


def _split(parameters: Any) -> tuple[Optional[Any], list[torch.Tensor], list[torch.Tensor]]:
    """(the engine owning some of ``parameters``, those parameters, the rest)."""
    from .engine import ZeroEngine

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    engine = next((e for e in map(ZeroEngine.owning, params) if e is not None), None)
    if engine is None:
        return None, [], params
    mine = [p for p in params if ZeroEngine.owning(p) is engine]
    rest = [p for p in params if ZeroEngine.owning(p) is not engine]
    if any(ZeroEngine.owning(p) is not None for p in rest):
        raise ValueError("clip_grad_norm_ got parameters of two lightning_zero engines: clip each model's own.")
    return engine, mine, rest


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> torch.Tensor:
    engine, mine, rest = _split(parameters)
    if engine is None:
        return _TORCH["clip_grad_norm_"](rest, max_norm, norm_type, error_if_nonfinite, foreach)
    norm_type = float(norm_type)
    with torch.no_grad():
        grads = engine.grads_of(mine)
        total = engine.grad_norm(None, norm_type, grads)
        others = [p for p in rest if p.grad is not None]
        if others:
            theirs = torch.nn.utils.get_total_norm([p.grad for p in others], norm_type, error_if_nonfinite,
                                                   foreach).to(total.device)
            total = (torch.maximum(total, theirs) if math.isinf(norm_type)
                     else torch.stack([total, theirs]).pow(norm_type).sum().pow(1.0 / norm_type))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
                               f"it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                               f"norm anyway, set `error_if_nonfinite=False`")
        engine.clip_grad_norm_(None, max_norm, norm_type, grads=grads, total=total)
        if others:
            torch.nn.utils.clip_grads_with_norm_(others, max_norm, total.to(others[0].grad.device), foreach)
    return total


def clip_grad_value_(parameters: Any, clip_value: float, foreach: Optional[bool] = None) -> None:
    engine, mine, rest = _split(parameters)
    if engine is not None:
        engine.clip_grad_value_(None, float(clip_value), grads=engine.grads_of(mine))
    if rest:
        _TORCH["clip_grad_value_"](rest, clip_value, foreach)


def install() -> None:
    """Route torch's two clipping functions through :func:`_split` (once per process)."""
    if _TORCH:
        return
    import torch.nn.utils.clip_grad as clip_module

    for name, ours in (("clip_grad_norm_", clip_grad_norm_), ("clip_grad_value_", clip_grad_value_)):
        _TORCH[name] = getattr(clip_module, name)
        ours.__wrapped__ = _TORCH[name]
        setattr(clip_module, name, ours)
        setattr(torch.nn.utils, name, ours)
