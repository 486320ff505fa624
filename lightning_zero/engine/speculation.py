"""Speculative host steps: what a unit's optimizer side was before a step that may have to be undone.

With gradient clipping or fp16 loss scaling, whether a step is taken as computed is only known
once every gradient of the window is in: the global norm may scale them all, an overflow on any
rank skips the step. Waiting for that would put the whole host step after backward. Instead the
overlap worker steps each offloaded unit as soon as its gradient lands, having first copied the
unit's fp32 master pieces and their optimizer state into buffers kept here; when the norm or the
overflow vote then demands it, those units get their old values and state back and take the
regular step (clipped) or none (skipped). Since the restored values are bit copies, the result is
bit-identical to stepping after backward. The buffers are allocated once per unit and reused:
host memory equal to the speculated units' master and state, counted in the host budget.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .flat_unit import FlatUnit

__all__ = ["Backups"]


class Backups:
    """Copies of offloaded units' master pieces and optimizer state, taken before each speculative step."""

    def __init__(self) -> None:
        self._buffers: dict[int, list[torch.Tensor]] = {}  # unit index -> reused copies
        self._saved: dict[int, list[tuple[Any, dict | None]]] = {}  # unit index -> per piece: (piece, its state)

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._buffers.values() for t in ts)

    def saved(self) -> set[int]:
        return set(self._saved)

    @torch.no_grad()
    def save(self, optimizer: torch.optim.Optimizer, units: Iterable[FlatUnit]) -> None:
        """Copy each unit's trainable pieces and their state (tensors copied, other values kept as they are)."""
        for unit in units:
            pieces = [p for p, param in zip(unit.pieces, unit.params) if p is not None and param.requires_grad]
            sources: list[torch.Tensor] = []
            record: list[tuple[Any, dict | None]] = []
            for piece in pieces:
                state = optimizer.state.get(piece)
                sources.append(piece.data)
                if state:
                    sources += [v for v in state.values() if torch.is_tensor(v)]
                    record.append((piece, {k: (None if torch.is_tensor(v) else v) for k, v in state.items()}))
                else:
                    record.append((piece, None))  # no state yet: the step creates it; undoing drops it
            copies = self._buffers.get(unit.index)
            if copies is None or [c.shape for c in copies] != [s.shape for s in sources] or any(
                    c.dtype != s.dtype for c, s in zip(copies, sources)):
                copies = self._buffers[unit.index] = [torch.empty_like(s, device="cpu") for s in sources]
            if sources:
                torch._foreach_copy_(copies, sources)
            self._saved[unit.index] = record

    @torch.no_grad()
    def restore(self, optimizer: torch.optim.Optimizer, units: Iterable[FlatUnit]) -> list[FlatUnit]:
        """Put the saved values and state back into ``units`` (those saved since the last ``forget``);
        returns the units restored."""
        restored = []
        for unit in units:
            record = self._saved.pop(unit.index, None)
            if record is None:
                continue
            copies = iter(self._buffers[unit.index])
            for piece, kept in record:
                piece.data.copy_(next(copies))
                if kept is None:
                    optimizer.state.pop(piece, None)
                    continue
                state = optimizer.state[piece]
                for key in list(state):
                    if key not in kept:
                        del state[key]
                for key, value in kept.items():
                    if value is None:
                        state[key].copy_(next(copies))
                    else:
                        state[key] = value
            restored.append(unit)
        return restored

    def forget(self) -> None:
        """The speculative steps stand (the step took them): nothing to undo any more."""
        self._saved.clear()

    def close(self) -> None:
        self._saved.clear()
        self._buffers.clear()
