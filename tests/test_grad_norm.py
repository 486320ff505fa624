"""``trainer.strategy.grad_norm``: Lightning's ``grad_norm`` for gradients that live in shards, equal to DDP's."""

from __future__ import annotations

import math

import pytest
from dist_utils import run_ranks
from grad_norm_cases import fit


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "zero2_offload"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_grad_norm_in_on_before_optimizer_step_equals_ddps(strategy, norm_type):
    reference = run_ranks(fit, 2, "ddp", norm_type, lightning=True)
    mine = run_ranks(fit, 2, strategy, norm_type, lightning=True)
    assert mine[0]["warned"]  # the hook is overridden: the setup says where the gradients are (rank 0 speaks)
    for ref, got in zip(reference, mine):
        assert len(got["seen"]) == len(ref["seen"]) == 3
        for want, have in zip(ref["seen"], got["seen"]):
            assert set(have) == set(want) and not any("unused" in k for k in have)
            for key, value in want.items():
                assert have[key] == pytest.approx(value, rel=1e-5), key
