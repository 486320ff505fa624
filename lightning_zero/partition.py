"""Pure partition math: where each parameter lives in a flat, padded, evenly sharded space.

No torch.distributed and no tensors here: these functions take element counts, a rank and
a world size and return plain records, so they are tested exhaustively in isolation.

[Note: the unit of sharding]
Parameters are grouped into *units* (a gradient bucket for stages 1/2, a module group for
stage 3). A unit's parameters are laid out back to back in one flat buffer, each start
aligned to ``align`` elements (so every view is aligned for vectorised kernels), and the
total is padded to a multiple of ``world_size * align``. Rank r owns the contiguous chunk
``[r * shard, (r + 1) * shard)``. Equal chunks are what reduce-scatter and all-gather need,
and aligned chunk starts keep each rank's shard aligned too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ALIGN", "Slot", "Piece", "UnitLayout", "layout_unit", "plan_buckets", "plan_offload", "chunk_units"]

ALIGN = 64  # elements; 128 B in 16-bit, 256 B in fp32


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Slot:
    """One parameter's place in its unit's flat buffer: ``[offset, offset + numel)``."""

    index: int
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that one rank owns.

    ``param_start`` indexes the flattened parameter, ``shard_start`` the rank's shard.
    """

    index: int
    param_start: int
    shard_start: int
    length: int


@dataclass(frozen=True)
class UnitLayout:
    """Layout of one unit: parameter slots, padded size and the even split across ranks."""

    slots: tuple[Slot, ...]
    padded_numel: int  # multiple of world_size * align
    world_size: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def numel(self) -> int:
        """Elements that belong to parameters (padding excluded)."""
        return sum(s.numel for s in self.slots)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of rank's chunk in the unit's flat space."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def pieces(self, rank: int) -> list[Piece]:
        """The parameter pieces rank owns, in flat order (padding owns nothing)."""
        lo, hi = self.shard_range(rank)
        out = []
        for slot in self.slots:
            start, end = max(slot.offset, lo), min(slot.end, hi)
            if start < end:
                out.append(Piece(slot.index, start - slot.offset, start - lo, end - start))
        return out


def layout_unit(numels: Sequence[int], world_size: int, align: int = ALIGN) -> UnitLayout:
    """Lay out parameters of ``numels`` elements in one flat unit sharded over ``world_size``.

    Args:
        numels: element count of each parameter, in unit order.
        world_size: number of ranks sharing the unit.
        align: each parameter start and each rank's chunk start is a multiple of this.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    slots, offset = [], 0
    for index, numel in enumerate(numels):
        if numel < 0:
            raise ValueError(f"parameter {index} has negative size {numel}")
        slots.append(Slot(index, offset, numel))
        offset = _round_up(offset + numel, align)
    padded = max(_round_up(offset, world_size * align), world_size * align)
    return UnitLayout(tuple(slots), padded, world_size)


def plan_buckets(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Split parameter indices into consecutive buckets of at most ``bucket_numel`` elements.

    A parameter larger than the bucket gets a bucket of its own. Order is preserved, so a
    caller passing parameters in reverse registration order gets buckets in roughly the
    order backward produces their gradients.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, numel in enumerate(numels):
        if current and size + numel > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += numel
    if current:
        buckets.append(current)
    return buckets


def plan_offload(sizes: Sequence[int], fraction: float) -> list[int]:
    """Indices of the units whose optimizer state moves to the host so that their share of
    ``sum(sizes)`` comes closest to ``fraction`` (whole units; ties offload fewer bytes).

    Units are taken in index order (the order backward finishes them: the first gradients to
    arrive go to the host, so their copies have the rest of backward to run), skipping a unit
    that would overshoot the target by more than leaving it out undershoots.
    """
    total = sum(sizes)
    target = fraction * total
    chosen, taken = [], 0
    for index, size in enumerate(sizes):
        if size and abs(taken + size - target) < abs(taken - target):
            chosen.append(index)
            taken += size
    return chosen


def chunk_units(sizes: Sequence[int], chunk_numel: int) -> list[list[int]]:
    """Consecutive groups of unit indices of about ``chunk_numel`` elements each (at least one unit):
    the host steps one group per optimizer call, amortizing the call while the previous group's
    updated values travel back to the device."""
    groups: list[list[int]] = []
    size = 0
    for index, n in enumerate(sizes):
        if not groups or size + n > chunk_numel:
            groups.append([])
            size = 0
        groups[-1].append(index)
        size += n
    return groups
