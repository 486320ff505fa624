"""Buffers and the layers that mix them with parameters, under 16-bit compute, as under DDP.

True modes (``bf16-true``, ``16-true``): Lightning converts the whole module, buffers included, so every
floating-point buffer takes the compute dtype (a causal mask, a position table, BatchNorm statistics,
spectral norm's vectors); left fp32 beside 16-bit parameters they would fail the first matmul.

Mixed modes: under DDP's autocast every parameter is fp32 and only the activations are 16-bit; here a
parameter is a 16-bit published copy while buffers stay fp32. Two kinds of layers meet both:
- BatchNorm: torch's batch_norm refuses a 16-bit weight beside fp32 statistics, so around the layer's
  forward its weight and bias are upcast to the statistics' dtype;
- parametrizations (``torch.nn.utils.parametrizations.spectral_norm``, ``weight_norm``, a user's): each
  computes from its fp32 inputs under DDP (spectral norm's power iteration is a ``torch.mv`` with fp32
  buffers, outside autocast), so its tensor inputs are upcast to fp32.
Both casts are differentiable: the gradient reaches the 16-bit parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["match_compute_dtype"]


def _upcast_affine(module: nn.Module, args: Any) -> None:
    stats = module.running_mean
    for name in ("weight", "bias"):
        param = module._parameters.get(name)
        if param is not None and stats is not None and param.dtype != stats.dtype and param.numel():
            module._upcast = getattr(module, "_upcast", {})
            module._upcast[name] = param
            module._parameters[name] = param.to(stats.dtype)  # read by forward as self.weight / self.bias


def _restore_affine(module: nn.Module, args: Any, output: Any) -> None:
    for name, param in getattr(module, "_upcast", {}).items():
        module._parameters[name] = param
    module._upcast = {}


def _upcast_inputs(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float32
                 else a for a in args)


def _parametrizations(module: nn.Module) -> list[nn.Module]:
    found = []
    for owner in module.modules():
        if parametrize.is_parametrized(owner):
            for plist in owner.parametrizations.values():
                found += list(plist)
    return found


def match_compute_dtype(module: nn.Module, compute_dtype: torch.dtype, mixed: bool) -> list[Any]:
    """Prepare ``module``'s buffers and mixed layers for ``compute_dtype`` (see the module note); returns the hook
    handles to remove."""
    if compute_dtype == torch.float32:
        return []
    if not mixed:
        for owner in module.modules():
            for name, buffer in list(owner._buffers.items()):
                if buffer is not None and buffer.is_floating_point() and buffer.dtype != compute_dtype:
                    owner._buffers[name] = buffer.to(compute_dtype)
        return []
    handles = []
    for norm in (m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)):
        handles.append(norm.register_forward_pre_hook(_upcast_affine))
        handles.append(norm.register_forward_hook(_restore_affine, always_call=True))
    for parametrization in _parametrizations(module):
        handles.append(parametrization.register_forward_pre_hook(_upcast_inputs))
    return handles
