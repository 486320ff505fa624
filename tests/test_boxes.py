"""Pure layout math of checkpoint/boxes.py against torch itself (chunk, indexing), exhaustively on small shapes."""

from __future__ import annotations

import itertools

import torch

from lightning_zero.checkpoint.boxes import chunk_range, flat_boxes, transfers
from lightning_zero.partition import layout_unit

SHAPES = [(), (1,), (7,), (3, 5), (4, 1, 3), (2, 3, 2, 2), (5, 0), (0, 4)]


def test_boxes_cover_exactly_the_flat_range_in_order():
    for shape in SHAPES:
        full = torch.arange(torch.Size(shape).numel()).reshape(shape)
        n = full.numel()
        for start, end in itertools.combinations(range(n + 1), 2):
            boxes = flat_boxes(shape, start, end)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            got, pos = [], start
            for box in boxes:
                region = full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))] if shape else full
                values = region.reshape(-1)
                assert box.start == pos == int(values[0]), (shape, start, end, box)
                assert values.tolist() == list(range(pos, pos + box.numel))  # contiguous run
                got += values.tolist()
                pos += box.numel
            assert got == list(range(start, end)), (shape, start, end, boxes)


def test_chunk_range_is_torch_chunk_of_dim0():
    for shape in SHAPES:
        if not shape:
            assert chunk_range(shape, 1, 3) == (0, 1)  # 0-d: replicated
            continue
        full = torch.arange(torch.Size(shape).numel()).reshape(shape)
        for world in (1, 2, 3, 4, 8):
            parts = list(torch.chunk(full, world, dim=0)) if shape[0] else []
            for rank in range(world):
                lo, hi = chunk_range(shape, rank, world)
                want = parts[rank].reshape(-1).tolist() if rank < len(parts) else []
                assert list(range(lo, hi)) == want, (shape, world, rank)


def test_transfers_move_every_piece_element_to_its_chunk_once():
    shapes = [(3, 5), (7,), (2, 3, 2), (1, 1)]
    for world in (1, 2, 3, 4):
        layout = layout_unit([torch.Size(s).numel() for s in shapes], world, align=4)
        for slot, shape in enumerate(shapes):
            pieces = []
            for rank in range(world):
                mine = [p for p in layout.pieces(rank) if p.index == slot]
                pieces.append((mine[0].param_start, mine[0].param_start + mine[0].length) if mine else None)
            moved = {}
            for t in transfers(shape, pieces, world, slot):
                assert pieces[t.src][0] <= t.param_start and t.param_start + t.length <= pieces[t.src][1]
                lo, hi = chunk_range(shape, t.dst, world)
                assert lo <= t.param_start and t.param_start + t.length <= hi
                for i in range(t.param_start, t.param_start + t.length):
                    assert i not in moved
                    moved[i] = t.dst
            assert sorted(moved) == list(range(torch.Size(shape).numel()))
