"""Trainable sets that change during training train as under DDP, and save and resume."""

from __future__ import annotations

import pytest
from dist_utils import run_ranks
from finetune_cases import finetune_many
from parity import assert_parity

REF = "ddp_find_unused_parameters_true"
STAGES = ("zero1", "zero2", "zero3")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = [(s, by_hand) for s in (REF, *STAGES) for by_hand in (False, True)]
    return run_ranks(finetune_many, 2, runs, str(tmp_path_factory.mktemp("ft")), lightning=True)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("by_hand", [False, True], ids=["BackboneFinetuning", "add_param_group"])
def test_changing_trainable_set_matches_ddp_and_resumes(results, stage, by_hand):
    for rank in results:
        ref = rank[(REF, by_hand)]["straight"]
        assert len(ref["losses"]) == 12
        assert_parity(rank[(stage, by_hand)]["straight"], ref)
        assert_parity(rank[(stage, by_hand)]["resumed"], ref)  # saved after the change, resumed for the last epoch


def test_reference_is_consistent(results):
    # the DDP reference itself resumes exactly and keeps its ranks equal (see FreezeAfterWrap)
    from parity import state_err

    for by_hand in (False, True):
        assert state_err(results[0][(REF, by_hand)]["resumed"]["state"], results[0][(REF, by_hand)]["straight"]["state"]) == 0
        assert state_err(results[0][(REF, by_hand)]["straight"]["state"], results[1][(REF, by_hand)]["straight"]["state"]) == 0
