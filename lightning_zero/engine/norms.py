"""Gradient norms over the ranks' pieces: the global norm (clipping) and each parameter's (``p.grad.norm(p)`` of DDP),
for gradients in shards, some of them offloaded to the host."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from ..collectives import Comm
from .flat_unit import FlatUnit
from .host import host_norms

__all__ = ["grad_norms", "global_norm", "any_nonfinite", "by_device"]


def by_device(tensors: Iterable[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    """Tensors grouped by device: foreach kernels take one device at a time (offloaded gradients are on the host)."""
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


def _norms(grads: list[torch.Tensor], ord: float, device: torch.device) -> list[torch.Tensor]:
    """Per-tensor norms of gradients on one device: offloaded (host) gradients of a GPU run row by row on every
    host thread (see host_norms); elsewhere torch's foreach kernel (what torch's clip_grad_norm_ does)."""
    if grads[0].device.type == "cpu" and device.type != "cpu":
        return host_norms(grads, ord)
    return torch._foreach_norm(grads, ord)


@torch.no_grad()
def global_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device, comm: Comm) -> torch.Tensor:
    """The norm of all ranks' ``grads`` (pieces of one gradient set) together, on ``device``. A collective."""
    local = torch.zeros((), device=device)
    for on_device in by_device(grads).values():
        if math.isinf(norm_type):
            part = torch.stack([g.abs().max() for g in on_device if g.numel()]
                               or [torch.zeros((), device=on_device[0].device)]).max()
            local = torch.maximum(local, part.float().to(device))
        else:
            local = local + torch.stack(_norms(on_device, norm_type, device)).pow(norm_type).sum().float().to(device)
    if math.isinf(norm_type):
        return comm.all_reduce(local.float().reshape(1), op="max")[0]
    return comm.all_reduce(local.float().reshape(1), op="sum")[0].pow(1.0 / norm_type)


@torch.no_grad()
def any_nonfinite(grads: list[torch.Tensor], device: torch.device, comm: Comm) -> bool:
    """True if any rank holds an inf/nan in ``grads`` (one all-reduce)."""
    found = torch.zeros(1, dtype=torch.float32, device=device)
    for on_device in by_device(grads).values():
        if not torch.isfinite(torch.stack(_norms(on_device, 1.0, device)).sum()):  # inf/nan anywhere
            found.fill_(1.0)
    return bool(comm.all_reduce(found, op="max").item() > 0)


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
