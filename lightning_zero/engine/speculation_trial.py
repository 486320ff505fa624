"""``speculative_step="auto"``: speculate only where it pays, decided from the first steps' timings.

A speculative host step (engine.speculation) first copies each unit's fp32 master and optimizer
state (12 bytes a parameter with AdamW, read and written) so that it can be undone. Against stepping
after backward it wins only the backward time it hides: a window takes about
``max(backward, copy + host step)`` instead of ``backward + host step``, so it is faster exactly when
the copy takes less than the backward. Which one holds depends on the host's memory bandwidth and on
how much compute a parameter gets (micro-batch, sequence, checkpointing): on an H100 machine's host,
1.3B GPT, micro-batch 8, the copy took longer than the backward and the speculative step made the
window 0.5 s slower. So under "auto" the first steps run after backward while their backward is
timed (CUDA events on the GPU); then the copy's time is estimated from a measured host copy and the
ranks decide together (the slowest ratio counts).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import torch

__all__ = ["SpeculationTrial", "host_copy_seconds_per_byte", "pays", "MARGIN", "WINDOWS"]

WINDOWS = 3  # steps timed before deciding; the first is left out (warm-up, allocator growth)
MARGIN = 0.75  # the copy must take less than this share of the backward it hides


def pays(copy_seconds: float, backward_seconds: float) -> bool:
    """Whether speculating is faster than stepping after backward (see the module docstring)."""
    return copy_seconds < MARGIN * backward_seconds


def host_copy_seconds_per_byte(nbytes: int = 256 * 2**20, repeats: int = 3) -> float:
    """Seconds a host-to-host copy takes per byte copied (best of ``repeats``, with this process's threads)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best / nbytes


class SpeculationTrial:
    """Times each backward of the first steps; ``ready`` once enough steps were taken."""

    def __init__(self, optimizer: Any, speculate: str, device: torch.device) -> None:
        self.optimizer, self.speculate, self.device = optimizer, speculate, device
        self.steps = 0
        self._open: Optional[Any] = None
        self._spans: list[tuple[Any, Any]] = []

    def _mark(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def backward_started(self) -> None:
        self._open = self._mark() if self.steps >= 1 else None  # the first step's backward is not timed

    def backward_ended(self) -> None:
        if self._open is not None:
            self._spans.append((self._open, self._mark()))
            self._open = None

    def stepped(self) -> bool:
        """A step (or a skipped one) ended; True when the trial has its timings."""
        self.steps += 1
        return self.steps >= WINDOWS and bool(self._spans)

    def backward_seconds(self) -> float:
        """The median backward of the timed steps (each micro-batch's backward counts alone)."""
        def seconds(start: Any, end: Any) -> float:
            if isinstance(start, float):
                return end - start
            end.synchronize()
            return start.elapsed_time(end) / 1000.0

        return statistics.median(seconds(a, b) for a, b in self._spans)
