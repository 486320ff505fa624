"""ZeroEngine (plain PyTorch, no Lightning) against DDP on 2 and 4 gloo ranks, fp32."""

from __future__ import annotations

import pytest
from dist_utils import run_ranks
from engine_cases import run_cases
from parity import assert_parity, state_err

# (reference key, options): options vary accumulation, clipping, optimizer and overlap.
VARIANTS = [
    dict(),
    dict(micro=3, clip="norm"),
    dict(clip="value", opt="sgd"),
    dict(micro=2, overlap=False),
]


def _cases(stages):
    cases = []
    for v in VARIANTS:
        cases.append(dict(mode="ddp", stage=0, **v))
        cases += [dict(mode="zero", stage=s, **v) for s in stages]
    return cases


@pytest.fixture(scope="module")
def world2():
    cases = _cases((1, 2))
    return cases, run_ranks(run_cases, 2, cases)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_engine_matches_ddp_world2(world2, stage, variant):
    cases, per_rank = world2
    for results in per_rank:
        ref = results[cases.index(dict(mode="ddp", stage=0, **VARIANTS[variant]))]
        run = results[cases.index(dict(mode="zero", stage=stage, **VARIANTS[variant]))]
        assert_parity(run, ref)
    # every rank ends with the same full parameters
    i = cases.index(dict(mode="zero", stage=stage, **VARIANTS[variant]))
    assert state_err(per_rank[1][i]["state"], per_rank[0][i]["state"]) == 0.0


@pytest.mark.slow
def test_engine_matches_ddp_world4():
    cases = [dict(mode="ddp", stage=0, micro=2, clip="norm"), dict(mode="zero", stage=2, micro=2, clip="norm"),
             dict(mode="zero", stage=1, micro=2, clip="norm", bucket=50)]
    per_rank = run_ranks(run_cases, 4, cases)
    for results in per_rank:
        assert_parity(results[1], results[0])
        assert_parity(results[2], results[0])


@pytest.mark.slow
def test_reduce_scatter_overlaps_backward():
    from engine_cases import launch_schedule

    on = run_ranks(launch_schedule, 2, True)[0]
    off = run_ranks(launch_schedule, 2, False)[0]
    assert on["units"] == off["units"] == 8
    for run in (on, off):  # both issue each bucket as soon as it is ready, while backward runs
        first_launch = next(i for i, (what, _) in enumerate(run["trace"]) if what == "launch")
        last_backward = max(i for i, (what, _) in enumerate(run["trace"]) if what == "backward")
        assert first_launch < last_backward, run["trace"]
        assert run["during_backward"] >= 7 and run["during_backward"] + run["after_backward"] == 8
    # overlapped: some reduction is still in flight when backward reaches the next layer
    in_flight = [on["trace"][i + 1][0] == "backward" for i, (what, _) in enumerate(on["trace"][:-1]) if what == "launch"]
    assert any(in_flight), on["trace"]
    # not overlapped: every launch is waited for before backward goes on
    for i, (what, k) in enumerate(off["trace"]):
        if what == "launch":
            assert off["trace"][i + 1] == ("done", k), off["trace"]


@pytest.mark.slow
def test_stage1_accumulates_in_fp32_by_default():
    from engine_cases import accumulation_error

    fp32 = run_ranks(accumulation_error, 2, "fp32")
    bf16 = run_ranks(accumulation_error, 2, "bf16")
    for exact, lossy in zip(fp32, bf16):
        assert exact["error"] < 1e-5, exact  # 64 bf16 micro-batch gradients summed in fp32
        assert lossy["error"] > 10 * exact["error"], (lossy, exact)  # the opt-in 16-bit buffer is really 16-bit
