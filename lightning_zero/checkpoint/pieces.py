"""A rank's ZeRO piece of a tensor as ``torch.distributed.checkpoint`` sees it: a list of boxes.

DCP reads into and writes from any tensor that describes its local part as chunks
(``__create_chunk_list__`` / ``__get_tensor_shard__`` / ``__create_write_items__``, the protocol
DTensor itself implements). :class:`PieceTensor` is that description for a flat piece: the boxes
of :func:`.boxes.flat_boxes`, each a view of the piece, so loading copies straight from the file
into the fp32 master or optimizer state and saving writes straight from it, whatever chunks the
other side used (FSDP2's rows, another world size's pieces, one whole tensor). It carries no
values of its own and supports no math: it exists only inside our save and load calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .boxes import flat_boxes

__all__ = ["PieceTensor"]


class PieceTensor(torch.Tensor):
    """Elements ``[start, start + local.numel())`` of a row-major tensor of ``shape`` (``local``: None
    where this rank holds none of it)."""

    _boxes: list[tuple[torch.Size, torch.Tensor]]

    @staticmethod
    def __new__(cls, local: Optional[torch.Tensor], shape: Sequence[int], start: int, dtype: torch.dtype
                ) -> PieceTensor:
        device = local.device if local is not None else torch.device("cpu")
        out = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device)
        boxes = []
        if local is not None and local.numel():
            if local.dtype != dtype or local.dim() != 1:
                raise ValueError(f"a piece is a 1-D {dtype} tensor, got {local.dim()}-D {local.dtype}")
            for box in flat_boxes(shape, start, start + local.numel()):
                view = local[box.start - start:box.start - start + box.numel].view(box.sizes)
                boxes.append((torch.Size(box.offsets), view))
        out._boxes = boxes
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise TypeError(f"PieceTensor only carries a checkpoint piece through torch.distributed.checkpoint; "
                        f"{func} is not supported on it.")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"PieceTensor(shape={tuple(self.shape)}, boxes={len(self._boxes)})"

    # ---- the DCP protocol (see torch.distributed.checkpoint.planner_helpers) ----
    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=view.shape) for offsets, view in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, view in self._boxes:
            if offsets == index.offset:
                return view
        raise ValueError(f"no box at {index.offset} of '{index.fqn}'")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.shape),
                                                      properties=TensorProperties.create_from_tensor(view),
                                                      size=self.shape))
                for offsets, view in self._boxes]
