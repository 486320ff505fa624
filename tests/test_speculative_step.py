"""Offloaded units stepped during backward under clipping and fp16 loss scaling (engine.speculation): the
result is bit-identical to stepping them after backward, and the steps the norm or an overflow undoes are
redone (or skipped) for real."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from speculation_cases import CASES, run_speculation


@pytest.fixture(scope="module")
def world2():
    return run_ranks(run_speculation, 2, lightning=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_speculative_host_step_is_bit_identical_to_stepping_after_backward(world2, case):
    for results in world2:
        fast, slow = results[case], results[case + "_after"]
        assert slow["stepped_in_backward"] == 0  # the reference really stepped after backward
        assert (fast["stepped_in_backward"], fast["batches_in_backward"]) > (0, 0), fast["stepped_in_backward"]
        assert fast["batches_in_backward"] > 0
        assert fast["global_step"] == slow["global_step"] > 0
        assert fast["losses"] == slow["losses"]
        assert fast["state"].keys() == slow["state"].keys()
        for key, value in slow["state"].items():
            assert torch.equal(fast["state"][key], value), key
        assert torch.equal(fast["trace"], slow["trace"])


@pytest.mark.slow
def test_undone_exactly_when_the_gradients_change(world2):
    for results in world2:
        # a norm of 1e6 never clips: every early step stands
        assert results["zero2_never_clips"]["speculations_undone"] == 0
        # 0.5 clips the tiny LM's first steps (its norm starts near 2): those are put back and redone
        assert results["zero2_clips"]["speculations_undone"] > 0
        assert results["zero3_clips"]["speculations_undone"] > 0
        assert results["zero3_clips_by_value"]["speculations_undone"] > 0
        # two steps overflow on rank 1: both ranks undo what they stepped early in them
        assert results["zero2_fp16_overflow"]["speculations_undone"] > 0
        assert results["zero2_fp16_overflow"]["scale"] == results["zero2_fp16_overflow_after"]["scale"]
