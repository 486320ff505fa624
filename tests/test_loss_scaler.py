"""DynamicLossScaler against DeepSpeed's rules and an independent reference written here.

The rules (DeepSpeed ``DynamicLossScaler.update_scale`` with its defaults):
* the scale starts at ``init_scale`` (2**16);
* an overflow first uses up hysteresis: while more than one hysteresis count is left the
  scale is kept and the count drops by one; with one left the scale is divided by the factor
  (never below ``min_scale``); an overflow with the scale already at ``min_scale`` and the
  hysteresis exhausted is an error;
* after ``scale_window`` clean steps since the last overflow (or since the start) the scale
  is multiplied by the factor and the hysteresis is restored; it keeps growing every further
  ``scale_window`` clean steps;
* ``dynamic=False`` keeps the initial scale forever.
"""

from __future__ import annotations

import copy
import json
import random

import pytest

from lightning_zero.precision.loss_scaler import DynamicLossScaler, LossScaleAtMinimumError


class ReferenceScaler:
    """Written from the rules in the module docstring, with a clean-step counter (not step indices)."""

    class AtMinimum(Exception):
        pass

    def __init__(self, init_scale=2.0**16, scale_window=1000, hysteresis=2, min_scale=1.0, scale_factor=2.0,
                 dynamic=True):
        self.scale = float(init_scale)
        self.window = scale_window
        self.hysteresis = hysteresis
        self.left = hysteresis
        self.min_scale = min_scale
        self.factor = scale_factor
        self.dynamic = dynamic
        self.clean = 0  # clean steps since the last overflow (or the start)

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.clean = 0
            if self.left > 1:
                self.left -= 1
                return
            if self.scale == self.min_scale:
                raise self.AtMinimum()
            self.scale = max(self.scale / self.factor, self.min_scale)
        else:
            self.clean += 1
            if self.clean == self.window:
                self.clean = 0
                self.scale *= self.factor
                self.left = self.hysteresis


def _run(scaler, overflows):
    out = []
    for flag in overflows:
        scaler.update(flag)
        out.append(scaler.scale)
    return out


def test_defaults_are_deepspeeds() -> None:
    s = DynamicLossScaler()
    assert s.scale == 2.0**16
    assert s.scale_window == 1000
    assert s.hysteresis == 2
    assert s.min_scale == 1.0
    assert s.scale_factor == 2.0


@pytest.mark.parametrize("window", [1, 2, 5, 1000])
def test_growth_after_exactly_the_window_from_start(window: int) -> None:
    s = DynamicLossScaler(init_scale=8.0, scale_window=window)
    for _ in range(window - 1):
        s.update(False)
        assert s.scale == 8.0
    s.update(False)
    assert s.scale == 16.0
    # keeps growing every further window of clean steps
    for _ in range(window - 1):
        s.update(False)
        assert s.scale == 16.0
    s.update(False)
    assert s.scale == 32.0


@pytest.mark.parametrize("window", [1, 3, 10])
def test_growth_window_counts_from_the_last_overflow(window: int) -> None:
    s = DynamicLossScaler(init_scale=1024.0, scale_window=window, hysteresis=1)
    for _ in range(window - 1):  # almost a full window, then an overflow resets the count
        s.update(False)
    s.update(True)
    assert s.scale == 512.0
    for _ in range(window - 1):
        s.update(False)
        assert s.scale == 512.0
    s.update(False)
    assert s.scale == 1024.0


def test_hysteresis_two_first_overflow_keeps_second_halves() -> None:
    s = DynamicLossScaler(init_scale=1024.0, scale_window=100, hysteresis=2)
    s.update(True)
    assert s.scale == 1024.0
    s.update(True)
    assert s.scale == 512.0
    # hysteresis stays exhausted until the scale grows: the next overflow halves at once
    s.update(True)
    assert s.scale == 256.0


def test_hysteresis_is_not_restored_by_clean_steps_alone() -> None:
    s = DynamicLossScaler(init_scale=1024.0, scale_window=10, hysteresis=2)
    s.update(True)  # uses the hysteresis
    for _ in range(5):
        s.update(False)
    s.update(True)
    assert s.scale == 512.0


def test_hysteresis_restored_after_growth() -> None:
    s = DynamicLossScaler(init_scale=1024.0, scale_window=4, hysteresis=3)
    s.update(True)
    s.update(True)
    s.update(True)
    assert s.scale == 512.0
    for _ in range(4):
        s.update(False)
    assert s.scale == 1024.0
    # full hysteresis again: two overflows absorbed, the third halves
    s.update(True)
    s.update(True)
    assert s.scale == 1024.0
    s.update(True)
    assert s.scale == 512.0


def test_min_scale_floor_and_error_at_minimum() -> None:
    s = DynamicLossScaler(init_scale=3.0, scale_window=100, hysteresis=1, min_scale=1.0)
    s.update(True)
    assert s.scale == 1.5
    s.update(True)
    assert s.scale == 1.0  # floored, not 0.75
    with pytest.raises(LossScaleAtMinimumError):
        s.update(True)


def test_error_at_minimum_waits_for_hysteresis() -> None:
    s = DynamicLossScaler(init_scale=2.0, scale_window=100, hysteresis=2, min_scale=2.0)
    s.update(True)  # absorbed by hysteresis even though the scale is at the minimum
    assert s.scale == 2.0
    with pytest.raises(LossScaleAtMinimumError):
        s.update(True)


def test_reaching_minimum_is_not_an_error() -> None:
    s = DynamicLossScaler(init_scale=4.0, scale_window=100, hysteresis=1, min_scale=1.0)
    s.update(True)
    s.update(True)
    assert s.scale == 1.0
    s.update(False)  # clean steps at the minimum are fine
    assert s.scale == 1.0


def test_static_scale_never_changes() -> None:
    s = DynamicLossScaler(init_scale=128.0, scale_window=1, hysteresis=1, min_scale=128.0, dynamic=False)
    rng = random.Random(5)
    for _ in range(500):
        s.update(rng.random() < 0.3)  # never raises "at the minimum" (runs of 10 overflows: see the static-limit test)
        assert s.scale == 128.0


@pytest.mark.parametrize(
    "kwargs",
    [dict(hysteresis=0), dict(scale_window=0), dict(min_scale=0.0), dict(min_scale=-1.0), dict(scale_factor=1.0)],
)
def test_invalid_settings(kwargs) -> None:
    with pytest.raises(ValueError):
        DynamicLossScaler(**kwargs)


def _random_config(rng: random.Random) -> dict:
    init_scale = 2.0 ** rng.randint(0, 20)
    # min_scale <= init_scale (ZeroConfig enforces it); 3.0 is not reachable by halving exactly
    min_scale = rng.choice([v for v in (1.0, 0.25, 4.0, 3.0) if v <= init_scale])
    return dict(
        init_scale=init_scale,
        scale_window=rng.choice([1, 2, 3, 7, 20, 100]),
        hysteresis=rng.randint(1, 4),
        min_scale=min_scale,
        scale_factor=rng.choice([2.0, 2.0, 3.0, 1.5]),
    )


def _compare_with_reference(config: dict, overflows: list[bool]) -> int:
    """Step both scalers through ``overflows``; returns the number of steps taken before an error."""
    impl = DynamicLossScaler(**config)
    ref = ReferenceScaler(**config)
    for step, flag in enumerate(overflows):
        try:
            ref.update(flag)
        except ReferenceScaler.AtMinimum:
            with pytest.raises(LossScaleAtMinimumError):
                impl.update(flag)
            return step
        impl.update(flag)
        assert impl.scale == ref.scale, (config, step)
        assert impl.cur_hysteresis == ref.left, (config, step)
    return len(overflows)


def test_matches_reference_on_long_random_sequences() -> None:
    rng = random.Random(2024)
    total_steps = errors = 0
    for _ in range(300):
        config = _random_config(rng)
        p = rng.choice([0.0, 0.005, 0.05, 0.2, 0.5, 0.9])
        n = rng.randint(50, 3000)
        # bursty sequences too: long clean runs broken by overflow storms
        if rng.random() < 0.3:
            overflows = []
            while len(overflows) < n:
                overflows += [False] * rng.randint(0, 3 * config["scale_window"]) + [True] * rng.randint(1, 5)
        else:
            overflows = [rng.random() < p for _ in range(n)]
        steps = _compare_with_reference(config, overflows)
        total_steps += steps
        errors += steps < len(overflows)
    # the sample exercised both long runs and the error at minimum
    assert total_steps > 100_000
    assert errors > 5


def test_state_dict_round_trip_mid_run_reproduces_trajectory() -> None:
    rng = random.Random(7)
    for _ in range(50):
        config = _random_config(rng)
        config["min_scale"] = 2.0**-1000  # never reached: keep the run going to the end
        p = rng.choice([0.01, 0.1, 0.3])
        overflows = [rng.random() < p for _ in range(rng.randint(20, 1500))]
        cut = rng.randint(0, len(overflows))

        uninterrupted = DynamicLossScaler(**config)
        full = _run(uninterrupted, overflows)

        first = DynamicLossScaler(**config)
        head = _run(first, overflows[:cut])
        state = json.loads(json.dumps(first.state_dict()))  # survives a plain serialisation
        first.update(True)  # mutating the source afterwards must not affect the saved state
        resumed = DynamicLossScaler(**config)
        resumed.load_state_dict(state)
        tail = _run(resumed, overflows[cut:])
        assert head + tail == full
        assert resumed.state_dict() == uninterrupted.state_dict()


def test_state_dict_is_a_copy() -> None:
    s = DynamicLossScaler(init_scale=64.0, scale_window=2)
    state = s.state_dict()
    snapshot = copy.deepcopy(state)
    s.update(True)
    s.update(False)
    s.update(False)
    assert state == snapshot


def test_overflow_counter_counts_all_overflows() -> None:
    s = DynamicLossScaler(init_scale=2.0**10, scale_window=3, min_scale=2.0**-40)
    rng = random.Random(3)
    flags = [rng.random() < 0.3 for _ in range(400)]
    _run(s, flags)
    assert s.state_dict()["overflows"] == sum(flags)


def test_a_static_scale_that_keeps_overflowing_is_an_error_not_a_run_of_skipped_steps() -> None:
    from lightning_zero.precision.loss_scaler import STATIC_OVERFLOW_LIMIT

    scaler = DynamicLossScaler(init_scale=1e30, dynamic=False)
    for _ in range(STATIC_OVERFLOW_LIMIT - 1):  # a burst shorter than the limit is skipped, as DeepSpeed skips it
        scaler.update(True)
    scaler.update(False)
    for _ in range(STATIC_OVERFLOW_LIMIT - 1):
        scaler.update(True)
    assert scaler.scale == 1e30
    with pytest.raises(LossScaleAtMinimumError, match="static loss scale 1e\\+30 overflowed .* consecutive steps"):
        scaler.update(True)


def test_zero_precision_under_another_strategy_is_an_error_not_an_unscaled_loss() -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroConfig, ZeroPrecision

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[ZeroPrecision("16-mixed")], max_steps=2, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match="ZeroPrecision is used without a ZeroStrategy"):
        trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    with pytest.raises(Exception, match="positive, finite static scale"):
        ZeroConfig(loss_scale=float("inf"))
