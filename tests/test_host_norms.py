"""Norms of offloaded (host) gradients: row by row, the same norm as torch's, closer to the exact value."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_zero.engine.host import NORM_ROW, host_norms


@pytest.mark.parametrize("ord", [1.0, 2.0, 3.0, math.inf])
def test_host_norms_equal_the_exact_norm(ord):
    g = torch.Generator().manual_seed(0)
    sizes = [0, 1, NORM_ROW - 1, NORM_ROW, 3 * NORM_ROW + 17, 40 * NORM_ROW]
    tensors = [torch.randn(n, generator=g) * (1 + i) for i, n in enumerate(sizes)]
    tensors.append(torch.randn(300, 700, generator=g))  # a 2-D gradient
    got = host_norms(tensors, ord)
    for t, value in zip(tensors, got):
        exact = torch.linalg.vector_norm(t.double(), ord) if t.numel() else torch.zeros((), dtype=torch.float64)
        assert value.dtype == torch.float32 and value.shape == ()
        assert abs(float(value) - float(exact)) <= 1e-5 * max(float(exact), 1e-30), (t.shape, ord)


def test_host_norms_are_closer_than_one_long_single_precision_sum():
    t = torch.randn(20_000_000, generator=torch.Generator().manual_seed(1)) + 0.5
    exact = float(torch.linalg.vector_norm(t.double()))
    rows = abs(float(host_norms([t], 2.0)[0]) - exact) / exact
    foreach = abs(float(torch._foreach_norm([t], 2.0)[0]) - exact) / exact
    assert rows < 1e-6 and rows <= foreach


def test_host_norms_see_inf_and_nan():
    t = torch.zeros(5 * NORM_ROW)
    t[3 * NORM_ROW + 5] = float("inf")
    assert math.isinf(float(host_norms([t], 1.0)[0])) and math.isinf(float(host_norms([t], 2.0)[0]))
    t[7] = float("nan")
    assert not math.isfinite(float(host_norms([t], 2.0)[0]))
