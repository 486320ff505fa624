"""Lightning's ``grad_norm(module, norm_type)`` over parameters whose gradients an engine holds.

The usual logging of gradient norms, ``self.log_dict(grad_norm(self.layer, 2))`` in ``on_before_optimizer_step``,
reads ``p.grad``, which is None here (the gradients live, reduced, in the engine's shards): it would log nothing,
silently. Once a strategy has built an engine, the function answers for the engine's parameters from the engine
(each parameter's norm over every rank's piece, as DDP's gradient gives it; a collective, as every rank's hook
calls it) and for any other parameter as before, with the same keys and total.

User code usually imports the function before any engine exists (``from lightning.pytorch.utilities import
grad_norm`` at the top of a file), which binds the function object itself; so the object's code is what changes
(once per process), to a dispatcher that calls Lightning's own code where no engine is involved.
"""

from __future__ import annotations

import types
from typing import Any, Union

import torch
from torch import nn

__all__ = ["install"]

_DISPATCH = "_lightning_zero_grad_norm"  # the dispatcher's name in Lightning's module (the code looks it up there)
_LIGHTNING: dict[str, Any] = {}  # a copy of Lightning's own function, once installed


def grad_norm(module: nn.Module, norm_type: Union[float, int, str], group_separator: str = "/") -> dict[str, Any]:
    from .engine import ZeroEngine

    named = list(module.named_parameters())
    engine = next((e for e in (ZeroEngine.owning(p) for _, p in named) if e is not None), None)
    if engine is None:
        return _LIGHTNING["grad_norm"](module, norm_type, group_separator)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    engine.comm.rendezvous("lightning.pytorch.utilities.grad_norm()", engine.config.rendezvous_timeout_s)
    held = engine.grad_norms(norm_type)  # by the engine's names, every rank's pieces
    norms: dict[str, Any] = {}
    for name, p in named:
        key = f"grad_{norm_type}_norm{group_separator}{name}"
        if ZeroEngine.owning(p) is engine:
            value = held.get(engine.names[id(p)])
            if value is not None:
                norms[key] = value
        elif p.grad is not None:
            norms[key] = p.grad.data.norm(norm_type)
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor([float(v) for v in norms.values()]).norm(norm_type)
    return norms


def _dispatcher(module: Any, norm_type: Any, group_separator: str = "/") -> Any:
    return _lightning_zero_grad_norm(module, norm_type, group_separator)  # noqa: F821 - Lightning's module global


def install() -> None:
    """Route Lightning's ``grad_norm`` through :func:`grad_norm` (once per process; see the module's note)."""
    if _LIGHTNING:
        return
    try:
        from lightning.pytorch.utilities import grads
    except ImportError:
        return
    original = grads.grad_norm
    if original.__code__.co_freevars or original.__code__.co_argcount != _dispatcher.__code__.co_argcount:
        return  # another Lightning's function than the one this replaces: leave it
    _LIGHTNING["grad_norm"] = types.FunctionType(original.__code__, original.__globals__, original.__name__,
                                                 original.__defaults__)
    original.__globals__[_DISPATCH] = grad_norm
    original.__code__ = _dispatcher.__code__
