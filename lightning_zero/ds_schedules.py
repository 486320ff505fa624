"""DeepSpeed's learning-rate schedules (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``).

[Note: DeepSpeed's schedule clock]
A DeepSpeed schedule counts ``last_batch_iteration`` from -1: at construction the optimizer gets
the value for iteration -1 (the minimum; 0 for WarmupCosineLR), and each ``step()`` first
advances the iteration and then sets the value. So optimizer step ``k`` (from 0) runs with the
value of iteration ``k - 1``. :class:`DeepSpeedSchedule` keeps that clock on torch's
``LRScheduler`` (``last_batch_iteration = last_epoch - 1``; Lightning accepts it as any torch
scheduler), saves the same ``{"last_batch_iteration": n}`` DeepSpeed saves, and loads DeepSpeed's.
OneCycle also cycles Adam's first beta as DeepSpeed does (``cycle_momentum``, on by default).
tests/test_deepspeed_checkpoints.py compares every schedule with DeepSpeed's own, recorded by
DeepSpeed in tests/fixtures/deepspeed.tar.gz.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from typing import Any, Optional

import torch

__all__ = ["SCHEDULES", "build_scheduler", "check_schedule_params", "DeepSpeedSchedule", "UnsupportedScheduleError"]

Values = Callable[[int], list]  # iteration -> one value per param group


class UnsupportedScheduleError(ValueError):
    """A DeepSpeed ``scheduler.type`` this importer does not know."""


def _per_group(value: Any, groups: int, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise UnsupportedScheduleError(f"scheduler params.{name} has {len(value)} values for {groups} param groups.")
        return [float(v) for v in value]
    return [float(value)] * groups


def _warmup_type(p: dict[str, Any], schedule: str) -> str:
    kind = p.get("warmup_type", "log")
    if kind not in ("log", "linear"):  # DeepSpeed falls back to log with a log line: here the run would differ silently
        raise UnsupportedScheduleError(f"{schedule} params.warmup_type={kind!r}: DeepSpeed's warm-up is 'log' or "
                                       f"'linear' (it would run 'log'); write the one you mean.")
    return kind


def _warm_fraction(it: int, warmup: int, kind: str) -> float:
    """DeepSpeed's warm-up gamma below ``warmup`` (``log`` or ``linear``)."""
    if kind == "linear":
        return it / warmup
    return math.log(it + 1) / math.log(warmup)


def _warmup(p: dict[str, Any], groups: int, base: list[float], decay: bool) -> tuple[Values, Optional[Values]]:
    lo = _per_group(p.get("warmup_min_lr", 0.0), groups, "warmup_min_lr")
    hi = _per_group(p.get("warmup_max_lr", 0.001), groups, "warmup_max_lr")
    warmup = max(2, int(p.get("warmup_num_steps", 1000)))
    kind = _warmup_type(p, "WarmupDecayLR" if decay else "WarmupLR")
    total = int(p["total_num_steps"]) if decay else 0

    def gamma(it: int) -> float:
        if it < warmup:
            return _warm_fraction(it, warmup, kind)
        if not decay:
            return 1.0
        return max(0.0, (total - it) / max(1.0, total - warmup))

    return (lambda it: lo if it < 0 else [a + (b - a) * gamma(it) for a, b in zip(lo, hi)]), None


def _warmup_lr(p: dict[str, Any], groups: int, base: list[float]) -> tuple[Values, Optional[Values]]:
    return _warmup(p, groups, base, decay=False)


def _warmup_decay_lr(p: dict[str, Any], groups: int, base: list[float]) -> tuple[Values, Optional[Values]]:
    return _warmup(p, groups, base, decay=True)


def _warmup_cosine_lr(p: dict[str, Any], groups: int, base: list[float]) -> tuple[Values, Optional[Values]]:
    total, warmup = int(p["total_num_steps"]), int(p.get("warmup_num_steps", 1000))
    if warmup <= 0:
        raise UnsupportedScheduleError(f"WarmupCosineLR needs warmup_num_steps > 0, got {warmup}.")
    warmup = max(2, warmup)
    lo, floor = float(p.get("warmup_min_ratio", 0.0)), float(p.get("cos_min_ratio", 0.0001))
    kind = _warmup_type(p, "WarmupCosineLR")

    def ratio(it: int) -> float:
        if it < 0:
            return 0.0
        if it < warmup:
            return lo + _warm_fraction(it, warmup, kind) * (1.0 - lo)
        progress = min(1.0, (it - warmup + 1) / max(1, total - warmup))
        return max(0.0, floor + (1.0 - floor) * (1.0 + math.cos(math.pi * progress)) / 2)

    return (lambda it: [b * ratio(it) for b in base]), None


def _one_cycle(p: dict[str, Any], groups: int, base: list[float]) -> tuple[Values, Optional[Values]]:
    lo = _per_group(p["cycle_min_lr"], groups, "cycle_min_lr")
    hi = _per_group(p["cycle_max_lr"], groups, "cycle_max_lr")
    first = float(p.get("cycle_first_step_size", 2000))
    second = float(p["cycle_second_step_size"]) if p.get("cycle_second_step_size") is not None else first
    if first <= 0 or second < 0:
        raise UnsupportedScheduleError("OneCycle needs cycle_first_step_size > 0 and cycle_second_step_size >= 0.")
    stairs_up = int(p.get("cycle_first_stair_count", 0))
    stairs_down = stairs_up if p.get("cycle_second_stair_count") is None else int(p["cycle_second_stair_count"])
    decay_size = float(p.get("decay_step_size", 0))
    lr_rate, mom_rate = float(p.get("decay_lr_rate", 0.0)), float(p.get("decay_mom_rate", 0.0))
    min_mom = _per_group(p.get("cycle_min_mom", 0.8), groups, "cycle_min_mom")
    max_mom = _per_group(p.get("cycle_max_mom", 0.9), groups, "cycle_max_mom")
    total = first + second
    up_share = first / total

    def scale(it: int) -> float:
        batch = it + 1
        x = 1.0 + batch / total - math.floor(1 + batch / total)
        factor, stairs = (x / up_share, stairs_up) if x <= up_share else ((x - 1) / (up_share - 1), stairs_down)
        if stairs > 0:
            at = batch % total
            position = at * stairs / first if at <= first else (total - at) * stairs / second
            factor = math.floor(position) / stairs
        return factor

    def lrs(it: int) -> list[float]:
        if it < 0:
            return lo
        if it < total:
            return [a + (b - a) * scale(it) for a, b in zip(lo, hi)]
        if math.isclose(decay_size, 0) or math.isclose(lr_rate, 0):
            return lo
        return [a / (1 + lr_rate * (it - total + 1) / decay_size) for a in lo]

    def moms(it: int) -> list[float]:
        if it < 0:
            return min_mom
        if it < total:
            return [b - (b - a) * scale(it) for a, b in zip(min_mom, max_mom)]
        if math.isclose(decay_size, 0) or math.isclose(mom_rate, 0):
            return max_mom
        return [b * (1 + mom_rate * (it - total + 1) / decay_size) for b in max_mom]

    return lrs, (moms if p.get("cycle_momentum", True) else None)


SCHEDULES = {"WarmupLR": _warmup_lr, "WarmupDecayLR": _warmup_decay_lr, "WarmupCosineLR": _warmup_cosine_lr,
             "OneCycle": _one_cycle}


_WARMUP = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"}
PARAMS = {"WarmupLR": _WARMUP, "WarmupDecayLR": _WARMUP | {"total_num_steps"},
          "WarmupCosineLR": {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                             "last_batch_iteration"},
          "OneCycle": {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size",
                       "cycle_second_step_size", "cycle_first_stair_count", "cycle_second_stair_count",
                       "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate",
                       "last_batch_iteration"}}


def check_schedule_params(kind: str, params: dict[str, Any]) -> None:
    """A misspelt parameter would leave its default in force (DeepSpeed itself refuses it): name it."""
    for key in sorted(set(params) - PARAMS[kind]):
        close = difflib.get_close_matches(key, sorted(PARAMS[kind]), n=1, cutoff=0.75)
        raise UnsupportedScheduleError(f"scheduler.params.{key} is not a parameter of DeepSpeed's {kind}"
                                       + (f" — did you mean '{close[0]}'?" if close else ".")
                                       + f" As written its default would stand. {kind} takes: "
                                       + ", ".join(sorted(PARAMS[kind])) + ".")


class DeepSpeedSchedule(torch.optim.lr_scheduler.LRScheduler):
    """A DeepSpeed schedule on torch's scheduler API (see [Note: DeepSpeed's schedule clock])."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, params: dict[str, Any]) -> None:
        base = [float(g["lr"]) for g in optimizer.param_groups]
        self.kind = kind
        params = dict(params)
        start = int(params.pop("last_batch_iteration", -1))  # DeepSpeed's argument to resume a schedule
        self._lrs, self._moms = SCHEDULES[kind](params, len(optimizer.param_groups), base)
        if self._moms is not None and "betas" not in optimizer.defaults:
            self._moms = None  # as DeepSpeed: no momentum cycling for an optimizer without betas
        super().__init__(optimizer)
        if start != -1:
            self._set(start)
            self._apply_momentum()

    @property
    def last_batch_iteration(self) -> int:
        return self.last_epoch - 1

    def get_lr(self) -> list[float]:
        return list(self._lrs(self.last_epoch - 1))

    def step(self, epoch: Optional[int] = None, last_batch_iteration: Optional[int] = None,
             batch_iteration: Optional[int] = None) -> None:
        """Advance one iteration, or jump to DeepSpeed's ``last_batch_iteration`` / ``batch_iteration``."""
        jump = last_batch_iteration if last_batch_iteration is not None else batch_iteration
        if jump is None:
            super().step(epoch)
        else:
            self._set(int(jump))
        self._apply_momentum()

    def _set(self, iteration: int) -> None:
        self.last_epoch = iteration + 1
        values = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            group["lr"] = lr
        self._last_lr = values

    def _apply_momentum(self) -> None:
        if self._moms is not None:
            for group, mom in zip(self.optimizer.param_groups, self._moms(self.last_epoch - 1)):
                group["betas"] = (mom, 0.99)  # DeepSpeed's OneCycle fixes the second beta at 0.99

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_epoch - 1, "type": self.kind}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Ours or DeepSpeed's (``{"last_batch_iteration": n}``)."""
        self._set(int(state_dict["last_batch_iteration"]))
        self._apply_momentum()


def build_scheduler(optimizer: torch.optim.Optimizer, spec: dict[str, Any]) -> DeepSpeedSchedule:
    """The schedule of DeepSpeed's ``{"type": ..., "params": {...}}``."""
    kind = spec.get("type")
    if kind not in SCHEDULES:
        raise UnsupportedScheduleError(f"DeepSpeed scheduler type {kind!r} is not supported: use one of "
                                       f"{', '.join(SCHEDULES)}, or configure the scheduler in configure_optimizers.")
    params = dict(spec.get("params", {}))
    check_schedule_params(kind, params)
    for key, value in list(params.items()):
        if value != "auto":
            continue
        if key == "warmup_max_lr":  # what Hugging Face's integration fills it with: the optimizer's lr
            params[key] = [float(g["lr"]) for g in optimizer.param_groups]
        else:
            raise UnsupportedScheduleError(f"scheduler.params.{key} is 'auto', which only Hugging Face's Trainer "
                                           f"fills: give it a value, or configure the scheduler yourself.")
    try:
        return DeepSpeedSchedule(optimizer, kind, params)
    except UnsupportedScheduleError:
        raise  # already names the parameter and the fix
    except KeyError as err:
        raise UnsupportedScheduleError(f"DeepSpeed scheduler {kind} needs params.{err.args[0]}.") from None
    except (TypeError, ValueError, ZeroDivisionError) as err:
        raise UnsupportedScheduleError(f"DeepSpeed scheduler {kind} params {params}: {err}; give numbers.") from None
