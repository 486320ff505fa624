"""Write a ``torch.save`` file one tensor at a time.

``torch.save`` pickles the whole object with every tensor in memory. Consolidating a sharded
checkpoint of a model larger than host memory cannot do that, so this writer pickles the
object with :class:`LazyTensor` placeholders (shape and dtype only) and then asks each one for
its values, writes them, and drops them: memory is bounded by the largest tensor. The file is
torch's own zip format (same records as ``torch.save``): ``torch.load`` reads it, with
``mmap=True`` and ``weights_only=True`` too.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["LazyTensor", "save_streaming", "materialize"]


class LazyTensor:
    """A tensor known by shape and dtype; ``load()`` produces its values when the writer needs them."""

    def __init__(self, shape: Any, dtype: torch.dtype, load: Callable[[], torch.Tensor]) -> None:
        self.shape, self.dtype, self.load = torch.Size(shape), dtype, load

    def numel(self) -> int:
        return self.shape.numel()


def materialize(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every LazyTensor read (entries naming one LazyTensor, tied weights, stay one tensor)."""
    loaded: dict[int, torch.Tensor] = {}
    return {k: loaded.setdefault(id(v), v.load()) if isinstance(v, LazyTensor) else v for k, v in state.items()}


class _Storage:
    __slots__ = ("key", "source")

    def __init__(self, key: str, source: Any) -> None:
        self.key, self.source = key, source


def _storage_type(dtype: torch.dtype) -> Any:
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def save_streaming(obj: Any, path: Any) -> int:
    """``torch.save(obj, path)`` where ``obj`` may hold :class:`LazyTensor`s; returns the bytes of tensor data."""
    storages: list[_Storage] = []
    seen: dict[int, _Storage] = {}

    class _Pickler(pickle.Pickler):
        def reducer_override(self, value: Any) -> Any:
            if isinstance(value, LazyTensor):
                ref = _Storage(str(len(storages)), value)
                storages.append(ref)
                args = (ref, 0, tuple(value.shape), _contiguous_strides(value.shape), False, collections.OrderedDict())
                return torch._utils._rebuild_tensor_v2, args
            return NotImplemented

        def persistent_id(self, value: Any) -> Any:
            if isinstance(value, _Storage):
                lazy = value.source
                return ("storage", _storage_type(lazy.dtype), value.key, "cpu", lazy.numel())
            if isinstance(value, torch.storage.TypedStorage):  # an ordinary tensor in the object
                ref = seen.get(value._cdata)
                if ref is None:
                    ref = seen[value._cdata] = _Storage(str(len(storages)), value)
                    storages.append(ref)
                return ("storage", getattr(torch, value._pickle_storage_type()), ref.key, "cpu", value._size())
            return None

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(obj)
    writer = torch._C.PyTorchFileWriter(str(Path(path)))
    records = {"data.pkl": buffer.getvalue(), ".format_version": "1",
               ".storage_alignment": str(torch.serialization._get_storage_alignment()), "byteorder": sys.byteorder}
    for name, value in records.items():
        writer.write_record(name, value, len(value))
    written = 0
    for ref in storages:
        if isinstance(ref.source, LazyTensor):
            tensor = ref.source.load().detach().to("cpu").reshape(ref.source.shape)
            if tensor.dtype != ref.source.dtype:
                raise TypeError(f"LazyTensor {ref.key} produced {tensor.dtype}, declared {ref.source.dtype}")
            if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            storage = tensor.untyped_storage()
        else:
            storage = ref.source._untyped_storage.cpu()
        writer.write_record(f"data/{ref.key}", storage, storage.nbytes())
        written += storage.nbytes()
        del storage
    writer.write_end_of_file()
    return written
