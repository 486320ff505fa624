"""A step skipped for fp16 overflow does not advance the LR schedule (DeepSpeed's rule; ``scheduler_on_skip``
"advance" gives Lightning's), in the strategy and the engine API, on 2 gloo ranks with the overflow on one."""

from __future__ import annotations

import pytest
from dist_utils import run_ranks
from skip_schedule_cases import OVERFLOW_AT, STEPS, engine_case, lightning_case


def _lambda_lrs(advances: list[int]) -> list[float]:
    return [1.0 / (1 + a) for a in advances]


@pytest.mark.parametrize("stage", [1, 3])
def test_strategy_holds_the_step_schedule_on_a_skipped_step(stage):
    held, advanced, epoch = (run_ranks(lightning_case, 2, stage, on_skip, interval, lightning=True)
                             for on_skip, interval in (("hold", "step"), ("advance", "step"), ("hold", "epoch")))
    skipped = len(OVERFLOW_AT)
    # the lr each step ran with: the scheduler advanced once per applied step before it
    applied_before = [sum(1 for j in range(i) if j not in OVERFLOW_AT) for i in range(STEPS)]
    for r in held:
        assert r["global_step"] == STEPS  # Lightning's global_step counts skipped steps too (DeepSpeed's global_steps)
        assert r["last_epoch"] == STEPS - skipped
        assert r["lrs"] == pytest.approx(_lambda_lrs(applied_before))
        assert r["applied"] is True and not r["hooked"]  # the wrapper is gone after fit
    for r in advanced:
        assert r["last_epoch"] == STEPS and r["lrs"] == pytest.approx(_lambda_lrs(list(range(STEPS))))
    for r in epoch:  # an epoch scheduler is not touched by the rule
        assert r["lrs"] == pytest.approx([1.0] * STEPS)


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_api_holds_the_schedule_on_a_skipped_step(stage):
    held, advanced, default = (run_ranks(engine_case, 2, stage, on_skip) for on_skip in ("hold", "advance", "default"))
    skipped = len(OVERFLOW_AT)
    for r in held + default:
        assert r["applied"] == [i not in OVERFLOW_AT for i in range(STEPS)]
        assert r["skipped"] == skipped and r["global_steps"] == STEPS
        assert r["iteration"] == STEPS - skipped - 1  # DeepSpeed's clock starts at -1
    assert held[0]["lrs"] == default[0]["lrs"]
    for r in advanced:
        assert r["iteration"] == STEPS - 1 and r["skipped"] == skipped
    # WarmupLR linear over 20 from 0 to 1: step k runs with iteration (applied steps before k) - 1
    expect = [max(sum(1 for j in range(i) if j not in OVERFLOW_AT) - 1, 0) / 20 for i in range(STEPS)]
    assert held[0]["lrs"] == pytest.approx(expect)
    assert advanced[0]["lrs"] == pytest.approx([max(i - 1, 0) / 20 for i in range(STEPS)])
