"""DeepSpeed's learning-rate schedules as torch ``LambdaLR`` factors (stepped every optimizer step).

The formulas follow DeepSpeed's ``runtime/lr_schedules.py``: WarmupLR (log or linear warm-up from
``warmup_min_lr`` to ``warmup_max_lr``, then constant), WarmupDecayLR (then linear decay to 0 at
``total_num_steps``), WarmupCosineLR (ratios of the optimizer's lr: warm-up from
``warmup_min_ratio``, then cosine down to ``cos_min_ratio``) and OneCycle (a triangle from
``cycle_min_lr`` up to ``cycle_max_lr`` and back, then decay). The optimizer's lr is set to the
schedule's reference value and the factor scales it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SCHEDULES", "build_scheduler", "UnsupportedScheduleError"]


class UnsupportedScheduleError(ValueError):
    """A DeepSpeed ``scheduler.type`` this importer does not know."""


def _gamma(step: int, warmup: int, kind: str) -> float:
    warmup = max(2, warmup)
    if step >= warmup:
        return 1.0
    if kind == "log":
        return math.log(step + 1) / math.log(warmup)
    return step / warmup


def _warmup_lr(p: dict[str, Any]) -> tuple[float, Callable[[int], float]]:
    lo, hi = float(p.get("warmup_min_lr", 0.0)), float(p.get("warmup_max_lr", 0.001))
    warmup, kind = int(p.get("warmup_num_steps", 1000)), p.get("warmup_type", "log")
    return hi, lambda s: (lo + (hi - lo) * _gamma(s, warmup, kind)) / hi if hi else 0.0


def _warmup_decay_lr(p: dict[str, Any]) -> tuple[float, Callable[[int], float]]:
    lo, hi = float(p.get("warmup_min_lr", 0.0)), float(p.get("warmup_max_lr", 0.001))
    warmup, kind = int(p.get("warmup_num_steps", 1000)), p.get("warmup_type", "log")
    total = int(p["total_num_steps"])

    def factor(s: int) -> float:
        if s < max(2, warmup):
            gamma = _gamma(s, warmup, kind)
        else:
            gamma = max(0.0, (total - s) / max(1.0, total - max(2, warmup)))
        return (lo + (hi - lo) * gamma) / hi if hi else 0.0

    return hi, factor


def _warmup_cosine_lr(p: dict[str, Any]) -> tuple[float, Callable[[int], float]]:
    total, warmup = int(p["total_num_steps"]), int(p.get("warmup_num_steps", 1000))
    lo, floor, kind = float(p.get("warmup_min_ratio", 0.0)), float(p.get("cos_min_ratio", 0.0001)), p.get("warmup_type", "log")

    def factor(s: int) -> float:
        if s < warmup:
            return lo + (1.0 - lo) * _gamma(s, warmup, kind)
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return float("nan"), factor  # ratios of the optimizer's own lr


def _one_cycle(p: dict[str, Any]) -> tuple[float, Callable[[int], float]]:
    lo, hi = float(p["cycle_min_lr"]), float(p["cycle_max_lr"])
    up = int(p.get("cycle_first_step_size", 2000))
    down = int(p.get("cycle_second_step_size") or up)
    decay_rate, decay_size = float(p.get("decay_lr_rate", 0.0)), int(p.get("decay_step_size", 0))

    def factor(s: int) -> float:
        if s <= up:
            lr = lo + (hi - lo) * s / max(1, up)
        elif s <= up + down:
            lr = hi - (hi - lo) * (s - up) / max(1, down)
        else:
            decays = (s - up - down) / decay_size if decay_size else 0.0
            lr = lo / (1.0 + decay_rate * decays)
        return lr / hi

    return hi, factor


SCHEDULES = {"WarmupLR": _warmup_lr, "WarmupDecayLR": _warmup_decay_lr, "WarmupCosineLR": _warmup_cosine_lr,
             "OneCycle": _one_cycle}


def build_scheduler(optimizer: torch.optim.Optimizer, spec: dict[str, Any]) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following DeepSpeed's ``{"type": ..., "params": {...}}``."""
    kind = spec.get("type")
    if kind not in SCHEDULES:
        raise UnsupportedScheduleError(f"DeepSpeed scheduler type {kind!r} is not supported: use one of "
                                       f"{', '.join(SCHEDULES)}, or configure the scheduler in configure_optimizers.")
    try:
        reference, factor = SCHEDULES[kind](dict(spec.get("params", {})))
    except KeyError as err:
        raise UnsupportedScheduleError(f"DeepSpeed scheduler {kind} needs params.{err.args[0]}.") from None
    if not math.isnan(reference):
        for group in optimizer.param_groups:
            group["lr"] = reference
            group["initial_lr"] = reference
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
