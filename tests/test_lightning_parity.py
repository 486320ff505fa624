"""LightningModules trained with Trainer(strategy=zero1/zero2) against DDP on gloo ranks."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from lightning_cases import bn_evaluated_after_fit_case, fit_case
from parity import assert_16bit_close, assert_parity, rel_err, state_err

LM = dict(accumulate=2, clip_val=0.5)
CASES = {
    "ddp": (("lm", "ddp"), LM),
    "zero1": (("lm", "zero1"), LM),
    "zero2": (("lm", "zero2"), LM),
    "zero2_nooverlap": (("lm", "zero2"), dict(LM, options=dict(overlap_comm=False, bucket=10_000))),
    "ddp_value": (("lm", "ddp"), dict(clip_val=0.02, clip_algo="value", epochs=2)),
    "zero1_value": (("lm", "zero1"), dict(clip_val=0.02, clip_algo="value", epochs=2)),
    "zero2_value": (("lm", "zero2"), dict(clip_val=0.02, clip_algo="value", epochs=2)),
    "gan_ddp": (("gan", "ddp_find_unused_parameters_true"), {}),
    "gan_zero1": (("gan", "zero1"), {}),
    "gan_zero2": (("gan", "zero2"), {}),
    "ddp_bf16": (("lm", "ddp"), dict(LM, precision="bf16-mixed")),
    "zero1_bf16": (("lm", "zero1"), dict(LM, precision="bf16-mixed")),
    "zero2_bf16": (("lm", "zero2"), dict(LM, precision="bf16-mixed", options=dict(reduce_dtype="fp32"))),
    "bn_ddp": (("bn", "ddp"), dict(accumulate=2)),
    "bn_zero2": (("bn", "zero2"), dict(accumulate=2)),
    "bn_zero3": (("bn", "zero3"), dict(accumulate=2, options=dict(min_group_params=10, param_persistence_threshold=0))),
    "bn_ddp_bf16": (("bn", "ddp"), dict(accumulate=2, precision="bf16-mixed")),
    "bn_zero2_bf16": (("bn", "zero2"), dict(accumulate=2, precision="bf16-mixed")),
    "bn_zero3_bf16": (("bn", "zero3"), dict(accumulate=2, precision="bf16-mixed",
                                            options=dict(min_group_params=10, param_persistence_threshold=0))),
    "bn_ddp_bf16true": (("bn", "ddp"), dict(accumulate=2, precision="bf16-true")),
    "bn_zero2_bf16true": (("bn", "zero2"), dict(accumulate=2, precision="bf16-true")),
    "bn_zero3_bf16true": (("bn", "zero3"), dict(accumulate=2, precision="bf16-true",
                                                options=dict(min_group_params=10, param_persistence_threshold=0))),
    "fp16_inject": (("lm", "zero2"), dict(plugin="16-mixed", inject=(2, 3), options=dict(initial_scale_power=8))),
}


def _many(rank, world, names):
    return {name: fit_case(rank, world, *CASES[name][0], **CASES[name][1]) for name in names}


@pytest.fixture(scope="module")
def world2():
    return run_ranks(_many, 2, list(CASES), lightning=True)


@pytest.mark.slow
@pytest.mark.parametrize("run,ref", [("zero1", "ddp"), ("zero2", "ddp"), ("zero2_nooverlap", "ddp"),
                                     ("zero1_value", "ddp_value"), ("zero2_value", "ddp_value"),
                                     ("gan_zero1", "gan_ddp"), ("gan_zero2", "gan_ddp"),
                                     ("bn_zero2", "bn_ddp"), ("bn_zero3", "bn_ddp")])
def test_fp32_parity_with_ddp(world2, run, ref):
    for results in world2:
        assert_parity(results[run], results[ref])
        assert results[run]["global_step"] == results[ref]["global_step"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("run", ["bn_zero2", "bn_zero3"])
def test_validation_during_fit_sees_rank0s_batchnorm_statistics_as_under_ddp(world2, run):
    # DDP's forward broadcasts rank 0's buffers before the first validation forward after a synchronizing step
    for results in world2:
        assert len(results[run]["val_losses"]) == len(results["bn_ddp"]["val_losses"]) > 0
        assert results[run]["val_losses"] == pytest.approx(results["bn_ddp"]["val_losses"], rel=1e-5)


@pytest.mark.slow
def test_evaluation_after_fit_on_the_same_trainer_uses_rank0s_batchnorm_statistics_as_under_ddp():
    runs = {s: run_ranks(bn_evaluated_after_fit_case, 2, s, lightning=True) for s in ("ddp", "zero2", "zero3")}
    for rank in range(2):
        ref = runs["ddp"][rank]
        for name in ("zero2", "zero3"):
            mine = runs[name][rank]
            assert torch.allclose(mine["running_mean"], ref["running_mean"], atol=1e-6), (name, rank)
            assert mine["val_losses"] == pytest.approx(ref["val_losses"], rel=1e-5), (name, rank)
            assert torch.allclose(mine["predictions"], ref["predictions"], atol=1e-5), (name, rank)


@pytest.mark.slow
def test_eval_after_fit_and_weights_handed_back(world2):
    for results in world2:
        assert results["zero2"]["dtype"] == "torch.float32"  # teardown gives the module back in fp32
        assert abs(results["zero2"]["val"]["val_loss"] - results["ddp"]["val"]["val_loss"]) < 1e-5
        assert abs(results["zero2"]["val"]["val_acc"] - results["ddp"]["val"]["val_acc"]) < 1e-6
        assert results["zero2"]["n_pred"] == results["ddp"]["n_pred"] > 0


@pytest.mark.slow
def test_bf16_close_to_ddp_autocast(world2):
    # bf16 parameters vs DDP's fp32 parameters under autocast: as close to fp32 training as DDP's bf16 is
    # (see parity.SIXTEEN_BIT_FACTOR)
    for results in world2:
        for name in ("zero1_bf16", "zero2_bf16"):
            assert_16bit_close(results[name], results["ddp_bf16"], results["ddp"])
        assert results["zero2_bf16"]["dtype"] == "torch.float32"


@pytest.mark.slow
@pytest.mark.parametrize("run,ref16", [("bn_zero2_bf16", "bn_ddp_bf16"), ("bn_zero3_bf16", "bn_ddp_bf16"),
                                       ("bn_zero2_bf16true", "bn_ddp_bf16true"),
                                       ("bn_zero3_bf16true", "bn_ddp_bf16true")])
def test_batchnorm_under_bf16_trains_as_under_ddp(world2, run, ref16):
    # mixed: BatchNorm's 16-bit weight meets its fp32 statistics; true: statistics in bf16 as Lightning converts them
    for results in world2:
        assert results[run]["global_step"] == results[ref16]["global_step"] > 0
        assert_16bit_close(results[run], results[ref16], results["bn_ddp"])


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_everywhere(world2):
    r0, r1 = world2[0]["fp16_inject"], world2[1]["fp16_inject"]
    # steps 2 and 3 overflowed on rank 1 only: no rank changed its parameters in those steps
    for r in (r0, r1):
        trace = r["trace"]
        assert rel_err(trace[2], trace[1]) == 0.0 and rel_err(trace[3], trace[1]) == 0.0
        assert rel_err(trace[4], trace[3]) > 0.0 and rel_err(trace[1], trace[0]) > 0.0
        # 2**8 -> hysteresis absorbs the first overflow -> halved at the second
        assert r["scale"] == 128.0
    assert state_err(r0["state"], r1["state"]) == 0.0


@pytest.mark.slow
def test_world4_parity():
    per_rank = run_ranks(_many, 4, ["ddp", "zero2", "zero1"], lightning=True)
    for results in per_rank:
        assert_parity(results["zero2"], results["ddp"])
        assert_parity(results["zero1"], results["ddp"])
