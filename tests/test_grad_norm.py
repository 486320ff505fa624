"""``trainer.strategy.grad_norm``: Lightning's ``grad_norm`` for gradients that live in shards, equal to DDP's."""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import run_ranks
from grad_norm_cases import fit, fit_torch_clipped


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "zero2_offload"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("via", ["strategy", "lightning"])
def test_grad_norm_in_on_before_optimizer_step_equals_ddps(strategy, norm_type, via):
    # via="lightning": the user's own `grad_norm(self, p)` and `grad_norm(self.body, p)`, imported before any engine
    reference = run_ranks(fit, 2, "ddp", norm_type, lightning=True)
    mine = run_ranks(fit, 2, strategy, norm_type, via, lightning=True)
    assert mine[0]["warned"]  # the hook is overridden: the setup says where the gradients are (rank 0 speaks)
    for ref, got in zip(reference, mine):
        assert len(got["seen"]) == len(ref["seen"]) == 3
        for want, have in zip(ref["seen"], got["seen"]):
            assert set(have) == set(want) and not any("unused" in k for k in have)
            for key, value in want.items():
                assert have[key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.parametrize("strategy", ["zero1", "zero3", "zero2_offload"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_torch_clip_functions_clip_the_engines_gradients_as_under_ddp(strategy, norm_type):
    # torch.nn.utils.clip_grad_norm_ / clip_grad_value_ over parameters whose .grad is None (the gradients are in
    # the engine) plus a tensor no engine holds: one total norm over both, every gradient scaled, as under DDP
    reference = run_ranks(fit_torch_clipped, 2, "ddp", norm_type, lightning=True)
    mine = run_ranks(fit_torch_clipped, 2, strategy, norm_type, lightning=True)
    for ref, got in zip(reference, mine):
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5) and len(ref["norms"]) == 3
        assert min(ref["norms"]) > 0.05  # the clip acts at every step
        assert got["outside"] == pytest.approx(ref["outside"], rel=1e-6)
        for key, value in ref["state"].items():
            assert torch.allclose(got["state"][key], value, rtol=1e-5, atol=1e-7), key
        # tensors no engine holds: torch's own result
        assert got["plain_norm"] == pytest.approx(got["plain_expected"], rel=1e-6)
        assert got["plain_clipped"] <= 0.1 + 1e-6
