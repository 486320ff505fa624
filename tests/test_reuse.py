"""A module a stage-3 Trainer trained, given to a new Trainer with ckpt_path; predict over uneven ranks."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from reuse_cases import predict_case, reuse_case


@pytest.mark.slow
@pytest.mark.parametrize("second", ["zero3", "zero2"])
@pytest.mark.parametrize("what", ["validate", "fit"])
def test_a_new_trainer_loads_a_checkpoint_into_a_module_stage_3_still_shards(tmp_path, what, second):
    """Lightning restored the checkpoint before setup, into a module whose parameters were the earlier engine's
    placeholders (a ShardedStateDictError); DDP is the reference for the same steps."""
    ours = run_ranks(reuse_case, 2, "zero3", second, what, str(tmp_path / "ours.ckpt"), lightning=True, timeout=240)
    ddp = run_ranks(reuse_case, 2, "ddp", "ddp", what, str(tmp_path / "ddp.ckpt"), lightning=True, timeout=240)
    for mine, ref in zip(ours, ddp):
        assert mine.get("step") == ref.get("step")
        if what == "validate":
            assert mine["val"] == pytest.approx(ref["val"], rel=1e-6)
        for key, value in ref["state"].items():
            torch.testing.assert_close(mine["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("n", [17, 3])
def test_predict_over_ranks_with_unequal_batch_counts_returns_what_ddp_returns(n):
    """Lightning's predict sampler does not pad: with 17 samples rank 0 predicts 9 and rank 1 8. Under stage 3 the
    short rank repeats its last batch (dropped) while rank 0 runs its ninth; it was refused before."""
    ours = run_ranks(predict_case, 2, "zero3", n, lightning=True, timeout=240)
    ddp = run_ranks(predict_case, 2, "ddp", n, lightning=True, timeout=240)
    assert [len(r["predictions"]) for r in ours] == [len(r["predictions"]) for r in ddp] == [(n + 1) // 2, n // 2]
    for mine, ref in zip(ours, ddp):
        assert mine["predictions"] == pytest.approx(ref["predictions"], rel=1e-5, abs=1e-6)

