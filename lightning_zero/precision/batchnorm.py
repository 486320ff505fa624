"""BatchNorm under 16-bit compute, as under DDP.

Mixed modes: a BatchNorm layer's weight and bias are 16-bit published copies here while its running
statistics stay fp32 (under DDP's autocast every parameter is fp32 and only the input is 16-bit);
torch's batch_norm refuses a 16-bit weight beside fp32 statistics, so around the layer's forward its
weight and bias are upcast to the statistics' dtype (a differentiable cast: the gradient reaches the
16-bit parameter). True modes: Lightning converts the whole module, buffers included, so the
floating-point buffers take the compute dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["match_batchnorm"]


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


def match_batchnorm(module: nn.Module, compute_dtype: torch.dtype, mixed: bool) -> list[Any]:
    """Prepare ``module``'s BatchNorm layers for ``compute_dtype`` (see the module note); returns hook handles."""
    if compute_dtype == torch.float32:
        return []
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not mixed:
        for norm in norms:
            for name, buffer in norm.named_buffers(recurse=False):
                if buffer.is_floating_point() and buffer.dtype != compute_dtype:
                    setattr(norm, name, buffer.to(compute_dtype))
        return []
    handles = []
    for norm in norms:
        handles.append(norm.register_forward_pre_hook(_upcast_affine))
        handles.append(norm.register_forward_hook(_restore_affine, always_call=True))
    return handles
