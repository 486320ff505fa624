"""Where each rank's part of a parameter lies, as ``torch.distributed.checkpoint`` shards.

[Note: one flat tensor per parameter]
A parameter is saved as a 1-D tensor of its numel elements (its row-major flattening); each
rank contributes the piece it owns (``partition.Piece``: ``param_start``, ``length``), which
for ZeRO's flat layout can start and end anywhere, even inside a row. DCP stores every piece
with its offset and, on load, copies the overlap between the saved pieces and the pieces of
the loading ranks, so any world size and any stage read the same directory without a
conversion step and without any rank holding more than its own part.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharding_spec import ShardMetadata

from ..partition import UnitLayout

__all__ = ["param_shards", "sharded_piece"]


def param_shards(layout: UnitLayout, slot: int) -> list[tuple[int, int, int]]:
    """``(rank, param_start, length)`` of every rank's piece of parameter ``slot``, by rank."""
    out = []
    for rank in range(layout.world_size):
        for piece in layout.pieces(rank):
            if piece.index == slot:
                out.append((rank, piece.param_start, piece.length))
    return out


def sharded_piece(local: Optional[torch.Tensor], numel: int, shards: list[tuple[int, int, int]],
                  rank: int, dtype: torch.dtype) -> ShardedTensor:
    """A 1-D ShardedTensor of ``numel`` elements whose local shard is ``local`` (None: no piece here).

    ``local`` is used in place: saving reads it, loading writes into it.
    """
    device = local.device if local is not None else torch.device("cpu")

    def placement(r: int) -> str:
        return f"rank:{r}/{device.type}" + (f":{device.index}" if device.index is not None and r == rank else "")

    metadata = [ShardMetadata([start], [length], placement(r)) for r, start, length in shards]
    mine = [Shard(local, md) for md, (r, _, _) in zip(metadata, shards) if r == rank]
    if local is not None and not mine:
        raise ValueError(f"rank {rank} holds a piece that the layout does not give it")
    global_md = ShardedTensorMetadata(metadata, torch.Size([numel]), TensorProperties(dtype=dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(mine, global_md)
