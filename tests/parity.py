"""Comparison helpers for parity tests: relative error against a reference run."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    scale = b.abs().max().item()
    diff = (a.float() - b.float()).abs().max().item()
    return diff / scale if scale > 0 else diff


def state_err(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))
    return max(rel_err(a[k], b[k]) for k in b)


def loss_err(a: list, b: list) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def assert_parity(run: dict, ref: dict, tol: float = 1e-5) -> None:
    s, lo = state_err(run["state"], ref["state"]), loss_err(run["losses"], ref["losses"])
    assert s <= tol and lo <= tol, f"parameters differ by {s:.2e}, losses by {lo:.2e} (tolerance {tol:g})"


def global_l2_err(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over all tensors together: robust to tiny tensors (biases) for 16-bit runs."""
    num = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in b)
    den = sum(float(b[k].float().pow(2).sum()) for k in b)
    return (num / den) ** 0.5
