"""Exhaustive property tests of lightning_zero.partition against brute-force references.

Nothing here restates the layout formulas: every check is a property of the sharding
contract (each element owned once, padding owned by nobody, equal aligned shards, ...)
verified element by element.
"""

from __future__ import annotations

import random

import pytest

from lightning_zero import partition

layout_unit = partition.layout_unit
plan_buckets = partition.plan_buckets

WORLD_SIZES = range(1, 9)
ALIGNS = (1, 4, 64)


def _numel_cases() -> list[list[int]]:
    cases = [
        [],
        [0],
        [0, 0, 0],
        [1],
        [1, 1, 1, 1, 1],
        [1, 0, 1],
        [0, 7, 0],
        [3, 5, 7, 11, 13],
        [64],
        [63, 65],
        [128, 1, 128],
        [1000],  # larger than a shard for every world size > 1
        [1, 1000, 1],
        [517, 3, 0, 250, 64, 1],
        [4096, 5],
    ]
    rng = random.Random(1234)
    for _ in range(25):
        n = rng.randint(1, 12)
        kind = rng.random()
        if kind < 0.3:
            case = [rng.randint(0, 8) for _ in range(n)]
        elif kind < 0.6:
            case = [rng.randint(0, 300) for _ in range(n)]
        else:
            case = [rng.choice([0, 1, 2, rng.randint(1, 2000)]) for _ in range(n)]
        cases.append(case)
    return cases


NUMEL_CASES = _numel_cases()


def _check_layout(numels: list[int], world: int, align: int) -> None:
    layout = layout_unit(numels, world, align)
    total = sum(numels)

    # --- global shape of the unit -------------------------------------------------------
    assert layout.world_size == world
    assert layout.padded_numel % (world * align) == 0
    assert layout.padded_numel >= max(total, 1)
    assert layout.shard_numel * world == layout.padded_numel
    assert layout.shard_numel % align == 0
    assert layout.numel == total

    # --- slots: one per parameter, in order, aligned, non-overlapping, back to back --------
    assert [s.index for s in layout.slots] == list(range(len(numels)))
    assert [s.numel for s in layout.slots] == list(numels)
    prev_end = 0
    for slot in layout.slots:
        assert slot.offset % align == 0, (slot, align)
        assert slot.end == slot.offset + slot.numel
        assert slot.offset >= prev_end, "slots overlap"
        # back to back: the start is the first aligned position at or after the previous end
        assert slot.offset - prev_end < align, "needless gap between slots"
        prev_end = slot.end
    assert prev_end <= layout.padded_numel
    # padding is as small as allowed: less than one extra world*align block (or the minimum block)
    assert layout.padded_numel - prev_end < world * align or layout.padded_numel == world * align

    # --- brute force ownership: flat position -> owning rank, from shard_range -------------
    flat_owner = [None] * layout.padded_numel
    prev_hi = 0
    for rank in range(world):
        lo, hi = layout.shard_range(rank)
        assert lo == prev_hi, "shards not contiguous"
        assert hi - lo == layout.shard_numel, "shards not equal"
        assert lo % align == 0
        for pos in range(lo, hi):
            assert flat_owner[pos] is None
            flat_owner[pos] = rank
        prev_hi = hi
    assert prev_hi == layout.padded_numel
    assert all(o is not None for o in flat_owner)

    # which flat positions hold parameter elements (from slots)
    flat_param = [None] * layout.padded_numel
    for slot in layout.slots:
        for e in range(slot.numel):
            assert flat_param[slot.offset + e] is None
            flat_param[slot.offset + e] = (slot.index, e)

    # --- brute force reconstruction from pieces -------------------------------------------
    # Simulate real data: each parameter element has a unique value; rank r's shard buffer is
    # filled from its pieces only; reconstructing every parameter from all shards must give
    # back the exact values, each element written exactly once.
    values = {(i, e): (i + 1) * 100_000 + e for i, n in enumerate(numels) for e in range(n)}
    owners: dict[tuple[int, int], int] = {}
    rebuilt = [[None] * n for n in numels]
    for rank in range(world):
        lo, hi = layout.shard_range(rank)
        shard = [None] * layout.shard_numel
        pieces = layout.pieces(rank)
        last_flat = -1
        for piece in pieces:
            assert piece.length > 0, "empty piece"
            slot = layout.slots[piece.index]
            assert 0 <= piece.param_start and piece.param_start + piece.length <= slot.numel
            assert 0 <= piece.shard_start and piece.shard_start + piece.length <= layout.shard_numel
            flat_start = lo + piece.shard_start
            assert flat_start > last_flat, "pieces not in flat order"
            last_flat = flat_start + piece.length - 1
            for k in range(piece.length):
                key = (piece.index, piece.param_start + k)
                # consistent with the slot: the flat position is the one the slot says
                assert flat_start + k == slot.offset + piece.param_start + k
                assert flat_param[flat_start + k] == key
                assert flat_owner[flat_start + k] == rank
                assert key not in owners, f"element {key} owned by ranks {owners[key]} and {rank}"
                owners[key] = rank
                assert shard[piece.shard_start + k] is None, "pieces overlap in the shard"
                shard[piece.shard_start + k] = values[key]
        # every shard position not covered by a piece is padding (no parameter lives there)
        for s, v in enumerate(shard):
            if v is None:
                assert flat_param[lo + s] is None, "a parameter element is owned by nobody"
        # reconstruct (as an all-gather + unflatten would) from the shard buffer
        for piece in pieces:
            for k in range(piece.length):
                cell = rebuilt[piece.index]
                assert cell[piece.param_start + k] is None
                cell[piece.param_start + k] = shard[piece.shard_start + k]

    assert len(owners) == total, "some parameter element is owned by nobody"
    for i, n in enumerate(numels):
        assert rebuilt[i] == [values[(i, e)] for e in range(n)]
    padding = sum(1 for p in flat_param if p is None)
    assert padding == layout.padded_numel - total


@pytest.mark.parametrize("align", ALIGNS)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_layout_exhaustive(world: int, align: int) -> None:
    for numels in NUMEL_CASES:
        _check_layout(numels, world, align)


def test_default_align_is_used() -> None:
    layout = layout_unit([3, 5], 2)
    assert all(s.offset % partition.ALIGN == 0 for s in layout.slots)
    assert layout.padded_numel % (2 * partition.ALIGN) == 0


def test_param_larger_than_shard_spans_ranks() -> None:
    layout = layout_unit([1000], 8, 1)
    assert layout.shard_numel < 1000
    owning = [r for r in range(8) if layout.pieces(r)]
    assert len(owning) == 8
    assert sum(p.length for r in owning for p in layout.pieces(r)) == 1000


def test_accepts_any_sequence() -> None:
    assert layout_unit((5, 6), 3, 4) == layout_unit([5, 6], 3, 4)
    assert layout_unit(range(4), 2, 4) == layout_unit([0, 1, 2, 3], 2, 4)


@pytest.mark.parametrize(
    "numels, world, align",
    [([1], 0, 1), ([1], -1, 1), ([1], 2, 0), ([1], 2, -4), ([3, -1], 2, 1), ([-5], 1, 1)],
)
def test_layout_bad_inputs(numels, world, align) -> None:
    with pytest.raises(ValueError):
        layout_unit(numels, world, align)


@pytest.mark.parametrize("world", [1, 3])
def test_shard_range_bad_rank(world: int) -> None:
    layout = layout_unit([10, 20], world, 4)
    for rank in (-1, world, world + 5):
        with pytest.raises(ValueError):
            layout.shard_range(rank)
        with pytest.raises(ValueError):
            layout.pieces(rank)


# --- plan_buckets ----------------------------------------------------------------------------


def _check_buckets(numels: list[int], limit: int) -> None:
    buckets = plan_buckets(numels, limit)
    flat = [i for b in buckets for i in b]
    # order kept, every index exactly once
    assert flat == list(range(len(numels)))
    assert all(b for b in buckets), "empty bucket"
    for b in buckets:
        # consecutive indices
        assert b == list(range(b[0], b[-1] + 1))
        size = sum(numels[i] for i in b)
        if size > limit:
            # only a single oversized parameter may exceed the limit, alone in its bucket
            big = [i for i in b if numels[i] > limit]
            assert len(big) == 1, (b, size, limit)
            assert all(numels[i] == 0 for i in b if i != big[0]), (b, limit)
    # no needless split: a bucket is closed only because the next parameter did not fit
    for left, right in zip(buckets, buckets[1:]):
        assert sum(numels[i] for i in left) + numels[right[0]] > limit, (left, right, limit)


def test_plan_buckets_exhaustive() -> None:
    rng = random.Random(99)
    limits = (1, 2, 3, 7, 10, 64, 100, 1000, 10**9)
    for numels in NUMEL_CASES:
        for limit in limits:
            _check_buckets(numels, limit)
    for _ in range(300):
        numels = [rng.choice([0, 1, rng.randint(1, 50), rng.randint(1, 500)]) for _ in range(rng.randint(0, 30))]
        _check_buckets(numels, rng.choice(limits))


def test_plan_buckets_examples() -> None:
    assert plan_buckets([], 10) == []
    assert plan_buckets([5], 1) == [[0]]
    # oversized parameters each get their own bucket, neighbours are not merged into them
    buckets = plan_buckets([2, 50, 2, 2, 60], 5)
    assert [0] in buckets and [1] in buckets and [4] in buckets
    assert sum(len(b) for b in buckets) == 5
    # exact fit is allowed
    assert plan_buckets([3, 2, 5], 5) == [[0, 1], [2]]


@pytest.mark.parametrize("limit", [0, -1, -100])
def test_plan_buckets_bad_limit(limit: int) -> None:
    with pytest.raises(ValueError):
        plan_buckets([1, 2], limit)
