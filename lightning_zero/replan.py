"""zero_auto's second look: the first step measures, and the plan follows the measurement.

``zero_auto`` plans before any step ran, with a share of the GPU kept for activations it cannot
know for a user's module (its micro-batch, sequence length, dtype and checkpointing only show in a
real step). The first step is therefore also a probe: the CUDA allocator's peak over its forward
and backward, above what the engine held when it began, is what this module's micro-batch really
needs. Until the first optimizer step nothing is lost: no optimizer has state and the masters hold
the initial values. So the strategy may, still inside that step, give the module back, plan again
and run the same batch under the new placement:

- out of GPU memory: with room for at least what the failed allocation asked for (one warning line);
- the measurement leaves room for a placement with less traffic (less offload) than the one the
  share allowed: that placement, planned with the measured activations plus a margin (one line).

The measurement works on any number of ranks: every rank reads its peak, the largest counts, rank 0
decides and every rank builds the new placement together. Out of memory only on one rank: with several,
a rank out of memory inside a collective sequence (a stage-3 gather, a gradient reduction) leaves the
others waiting in it, so there the error stands, with the way out, and the first plan is kept.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

__all__ = ["OOM", "PeakMeter", "Replanner", "requested_bytes", "MEASURED_MARGIN"]

OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_MIN_STEP = 16 * 2**20
MEASURED_MARGIN = 1.15  # a measured first step plans with this much more (allocator rounding, a longer batch)
MEASURED_SLACK = 256 * 2**20  # and at least this much


def requested_bytes(message: str) -> int:
    """The allocation an out-of-memory error names ("Tried to allocate 1.50 GiB"), 0 if none."""
    found = re.search(r"[Tt]ried to allocate ([0-9.]+) ?(bytes|B|KiB|MiB|GiB|TiB)", message)
    return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else 0


class Replanner:
    """How much more activation room each re-plan reserves, and whether one may still happen."""

    def __init__(self, limit: int = 3) -> None:
        self.limit, self.count, self.extra = limit, 0, 0
        self.meter = PeakMeter()
        self.measured: Optional[int] = None  # activation bytes the first step used, once read

    def possible(self, optimizers: list[Any]) -> bool:
        from .engine.optim import unwrap

        return self.count < self.limit and not any(unwrap(o).state for o in optimizers)  # nothing changed yet

    def grow(self, error: BaseException) -> int:
        """The activation room to plan with now: what the failed allocation asked for, doubled at each
        further failure (one allocation that fails is seldom the last the step needs)."""
        self.count += 1
        self.extra = max(2 * self.extra, requested_bytes(str(error)), _MIN_STEP)
        return self.extra

    def planned_activations(self) -> int:
        """The activation bytes to plan with after the first step measured them (with the margin)."""
        assert self.measured is not None
        return max(int(self.measured * MEASURED_MARGIN), self.measured + MEASURED_SLACK) + self.extra


class PeakMeter:
    """The CUDA allocator's peak between ``start`` and ``read``, above what was allocated at ``start``.
    ``read`` gives None where there is no such allocator (CPU training: the planner's "GPU" is the host)."""

    def __init__(self) -> None:
        self.device: Optional[torch.device] = None
        self.base = 0

    def start(self, device: torch.device) -> None:
        self.device = device if device.type == "cuda" else None
        if self.device is not None:
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> Optional[int]:
        if self.device is None:
            return None
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.base)
