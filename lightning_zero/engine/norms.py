"""Each parameter's gradient norm over the ranks' pieces: ``p.grad.norm(p)`` of DDP, for gradients in shards."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..collectives import Comm
from .flat_unit import FlatUnit

__all__ = ["grad_norms"]


@torch.no_grad()
def grad_norms(slots: Sequence[tuple[FlatUnit, int]], device: torch.device, comm: Comm,
               norm_type: float) -> dict[str, torch.Tensor]:
    """The norm of each (unit, slot)'s gradient (``inf``: the max), by name. A collective (one all-reduce)."""
    local = torch.zeros(len(slots), dtype=torch.float64, device=device)
    for i, (unit, slot) in enumerate(slots):
        piece = unit.pieces[slot]
        if piece is not None and piece.grad is not None and piece.grad.numel():
            grad = piece.grad.detach().to(device, torch.float64)  # an offloaded gradient is on the host
            local[i] = grad.abs().max() if math.isinf(norm_type) else grad.abs().pow(norm_type).sum()
    if slots:
        comm.all_reduce(local, op="max" if math.isinf(norm_type) else "sum")
    norms = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
    return {unit.names[slot]: norm.float() for (unit, slot), norm in zip(slots, norms)}
