"""Pure layout math between ZeRO's flat pieces and DTensor's ``Shard(0)`` chunks.

No tensors and no torch.distributed: shapes, ranks and element offsets in, plain records out.

[Note: pieces and chunks]
ZeRO packs a unit's parameters into one flat buffer and gives each rank an equal contiguous
range of it, so a rank's part of one parameter (its *piece*) is a flat range of the
parameter's row-major flattening that can start and end anywhere, even inside a row.
DTensor's ``Shard(0)`` (what FSDP2 and ``torch.distributed.checkpoint.state_dict`` use) gives
rank r the rows ``[r*c, (r+1)*c)`` with ``c = ceil(rows / world)`` (torch.chunk), which is
also a flat range of the flattening, but a different one. Two consequences:

- building a DTensor from pieces moves each element from the rank that holds it to the rank
  whose chunk contains it (:func:`transfers`: the overlaps of flat ranges, both sides compute
  the same list, so an all-to-all needs no negotiation);
- reading or writing a checkpoint needs no such move: a flat range of a row-major tensor is
  the union of at most ``2 * ndim - 1`` boxes (:func:`flat_boxes`), each a contiguous run of
  the range, so DCP can copy between the saved boxes or chunks and a rank's piece directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

__all__ = ["Box", "Transfer", "chunk_range", "flat_boxes", "transfers", "overlap"]


@dataclass(frozen=True)
class Box:
    """``offsets`` / ``sizes`` of a box of a tensor; ``start`` is its first element's flat index."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class Transfer:
    """Elements ``[param_start, param_start + length)`` of parameter ``slot`` go from ``src`` to ``dst``."""

    slot: int
    src: int
    dst: int
    param_start: int
    length: int


def chunk_range(shape: Sequence[int], rank: int, world: int) -> tuple[int, int]:
    """Flat ``[start, end)`` of rank's ``Shard(0)`` chunk (``Replicate`` for a 0-d tensor: all of it)."""
    numel = math.prod(shape)
    if not shape:
        return 0, numel
    rows = shape[0]
    inner = numel // rows if rows else 0
    per = -(-rows // world)
    lo, hi = min(rank * per, rows), min((rank + 1) * per, rows)
    return lo * inner, hi * inner


def overlap(a: tuple[int, int], b: tuple[int, int]) -> Optional[tuple[int, int]]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def _strides(shape: Sequence[int]) -> list[int]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return out[::-1]


def flat_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The boxes whose union is the flat range ``[start, end)`` of a row-major tensor of ``shape``,
    in flat order; each is a contiguous run of the range."""
    shape = tuple(shape)
    if end <= start:
        return []
    if not shape:
        return [Box((), (), 0)]
    strides = _strides(shape)
    out: list[Box] = []

    def rec(dim: int, base: tuple[int, ...], lo: int, hi: int, flat0: int) -> None:
        # [lo, hi) are flat offsets inside the sub-tensor shape[dim:], whose first element is flat0
        if dim == len(shape) - 1:
            out.append(Box(base + (lo,), (1,) * dim + (hi - lo,), flat0 + lo))
            return
        inner = strides[dim]
        first, last = lo // inner, (hi - 1) // inner
        head = lo % inner
        if head:  # a partial first row
            stop = min(hi, (first + 1) * inner)
            rec(dim + 1, base + (first,), head, stop - first * inner, flat0 + first * inner)
            lo, first = stop, first + 1
            if lo >= hi:
                return
        full_end = hi // inner  # rows [first, full_end) are whole
        if full_end > first:
            rest = (0,) * (len(shape) - dim - 1)
            out.append(Box(base + (first,) + rest, (1,) * dim + (full_end - first,) + shape[dim + 1:],
                           flat0 + first * inner))
            lo = full_end * inner
        if lo < hi:  # a partial last row
            rec(dim + 1, base + (last,), 0, hi - last * inner, flat0 + last * inner)

    rec(0, (), start, end, 0)
    return out


def transfers(shape: Sequence[int], pieces: Sequence[Optional[tuple[int, int]]], world: int,
              slot: int = 0) -> list[Transfer]:
    """Moves that turn ``pieces[r]`` (rank r's flat ``[start, end)`` of the parameter, or None) into
    every rank's ``Shard(0)`` chunk, ordered by (src, dst)."""
    out = []
    for src, piece in enumerate(pieces):
        if piece is None:
            continue
        for dst in range(world):
            ov = overlap(piece, chunk_range(shape, dst, world))
            if ov is not None:
                out.append(Transfer(slot, src, dst, ov[0], ov[1] - ov[0]))
    return out
