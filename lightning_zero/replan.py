"""zero_auto's second chance: out of GPU memory in the first step, plan again and go on.

``zero_auto`` plans before any step ran, with a share of the GPU kept for activations it cannot
measure in a user's module. When the first step still runs out of memory, nothing is lost yet: no
optimizer has state and the masters hold the initial values. The strategy then gives the module
back, plans again with room for at least what the failed allocation asked for, builds the engine
of the new placement and runs the same batch again (one warning line). Only on one rank: with
several, a rank out of memory inside a collective sequence (a stage-3 gather, a gradient
reduction) leaves the others waiting in it, so there the error stands, with the way out.
"""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["OOM", "Replanner", "requested_bytes"]

OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_MIN_STEP = 16 * 2**20


def requested_bytes(message: str) -> int:
    """The allocation an out-of-memory error names ("Tried to allocate 1.50 GiB"), 0 if none."""
    found = re.search(r"[Tt]ried to allocate ([0-9.]+) ?(bytes|B|KiB|MiB|GiB|TiB)", message)
    return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else 0


class Replanner:
    """How much more activation room each re-plan reserves, and whether one may still happen."""

    def __init__(self, limit: int = 3) -> None:
        self.limit, self.count, self.extra = limit, 0, 0

    def possible(self, world_size: int, optimizers: list[Any]) -> bool:
        from .engine.optim import unwrap

        return (self.count < self.limit and world_size == 1
                and not any(unwrap(o).state for o in optimizers))  # before the first step changed anything

    def grow(self, error: BaseException) -> int:
        """The activation room to plan with now: what the failed allocation asked for, doubled at each
        further failure (one allocation that fails is seldom the last the step needs)."""
        self.count += 1
        self.extra = max(2 * self.extra, requested_bytes(str(error)), _MIN_STEP)
        return self.extra
