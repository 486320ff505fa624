"""After ``fit`` no rank gathers the model: stage 3 stays sharded (evaluation runs sharded), stages 1/2
hand the module back holding the trained values; the full weights come from the strategy on request."""

from __future__ import annotations

import pytest
import torch
from after_fit_cases import after_fit_case
from dist_utils import run_ranks


@pytest.fixture(scope="module")
def runs():
    return run_ranks(after_fit_case, 2, lightning=True, timeout=600)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_teardown_gathers_nothing_in_fp32(runs, stage):
    for r in runs:
        assert r[(stage, "32-true")]["teardown_gathered"] == 0


def test_stage3_teardown_gathers_nothing_in_mixed_precision(runs):
    for r in runs:
        assert r[(3, "bf16-mixed")]["teardown_gathered"] == 0


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_2_module_holds_the_trained_fp32_values(runs, stage, precision):
    for r in runs:
        case = r[(stage, precision)]
        module_state, full = case["module_state"], case["full"]
        assert module_state.keys() == full.keys()
        for key, value in full.items():
            assert module_state[key].dtype == torch.float32, key
            assert torch.equal(module_state[key], value), key


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_stage3_state_dict_is_a_clear_error(runs, precision):
    for r in runs:
        message = r[(3, precision)]["state_dict_error"]
        assert "sharded" in message and "full_state_dict()" in message and "lightning_zero.consolidate" in message


def test_stage3_evaluates_sharded_after_fit(runs):
    for r in runs:
        case = r[(3, "32-true")]
        assert case["still_sharded"]
        assert abs(case["validate"] - case["plain_val"]) <= 1e-5 * abs(case["plain_val"])
        assert case["predicted"] == 2


def test_full_state_dict_agrees_across_stages_and_ranks(runs):
    ref = runs[0][(2, "32-true")]["full"]
    for r in runs:
        for stage in (1, 3):
            full = r[(stage, "32-true")]["full"]
            assert max(float((full[k] - v).abs().max()) for k, v in ref.items()) <= 1e-5


def test_a_new_trainer_takes_over_a_module_left_sharded(runs):
    for r in runs:
        case = r[(3, "32-true")]
        assert case["refit_steps"] == 5 and case["refit_state_ok"]


@pytest.mark.parametrize("kept", ["sharded", "persistent"])
def test_stage3_in_mixed_precision_hands_user_code_the_fp32_model(runs, kept):
    """After a bf16-mixed fit the module's parameters are fp32 as under DDP: a forward outside the trainer computes
    with the trained fp32 weights (no dtype error), and a model kept gathered gives its fp32 state_dict."""
    for r in runs:
        case = r[(3, "bf16-mixed", "persistent")] if kept == "persistent" else r[(3, "bf16-mixed")]
        assert case["param_dtypes"] == ["torch.float32"]
        assert torch.allclose(case["logits"], case["plain_logits"], rtol=1e-5, atol=1e-6)
        if kept == "persistent":
            for key, value in case["full"].items():
                assert case["module_state"][key].dtype == torch.float32 and torch.equal(case["module_state"][key], value)
