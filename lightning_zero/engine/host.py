"""Host memory for offloaded state: page-locked once at setup, reused every step.

[Note: pinning]
Copies between the GPU and host memory run asynchronously (and at full PCIe speed) only from
page-locked memory. Pinning is slow (about 0.75 s per GiB on the benchmark machine), so it
happens once, for one large arena per kind of state, and every unit's tensor is a view of it.
The arena is page-locked with ``cudaHostRegister`` on ordinary memory rather than allocated
by torch's pinned allocator, which rounds each block up to a power of two (5.4 GiB of masters
would take 8 GiB).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from ..partition import chunk_units
from .flat_unit import FlatUnit

__all__ = ["HostArena", "HostBackend", "HOST_STEP_CHUNK", "host_norms"]

HOST_STEP_CHUNK = 64_000_000  # elements per host optimizer call: large enough that its overhead vanishes
NORM_ROW = 1 << 16  # elements per row of a host norm (see host_norms)


def host_norms(tensors: Sequence[torch.Tensor], ord: float) -> list[torch.Tensor]:
    """The ``ord``-norm of each host tensor, like ``torch._foreach_norm`` but over rows of ``NORM_ROW`` elements
    first, then over the rows' norms (the same norm: for finite p, the p-th powers add up row by row; for inf, a
    max of maxima). torch reduces a long 1-D CPU tensor on one thread and in long single-precision runs: over the
    1.3B offloaded gradients of a 1.3B model that took 0.4 s of every clipped step, and sums of tens of millions
    of squares drifted by 1e-3; rows run on every intra-op thread and each sums a short run."""
    out = []
    for t in tensors:
        flat = t.reshape(-1)
        whole = flat.numel() // NORM_ROW * NORM_ROW
        if flat.numel() == 0:
            out.append(flat.new_zeros(()))
        elif whole == 0:
            out.append(torch.linalg.vector_norm(flat, ord))
        else:
            rows = torch.linalg.vector_norm(flat[:whole].view(-1, NORM_ROW), ord, dim=1)
            if whole < flat.numel():
                rows = torch.cat([rows, torch.linalg.vector_norm(flat[whole:], ord).reshape(1)])
            out.append(torch.linalg.vector_norm(rows, ord))
    return out


def _register(tensor: torch.Tensor) -> bool:
    """Page-lock ``tensor``'s memory in place; False when CUDA cannot (then it stays pageable)."""
    try:
        cudart = torch.cuda.cudart()
        ptr, nbytes = tensor.data_ptr(), tensor.untyped_storage().nbytes()
        if int(cudart.cudaHostRegister(ptr, nbytes, 0)) != 0:
            return False
    except (RuntimeError, AttributeError):
        return False
    return True


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except (RuntimeError, AttributeError):  # interpreter shutdown: the process is ending anyway
        pass


class HostArena:
    """One flat host tensor holding several same-dtype buffers back to back.

    Args:
        sizes: element count of each buffer.
        dtype: their dtype.
        pin: page-lock the arena (only meaningful when a CUDA device copies from it).
    """

    def __init__(self, sizes: Sequence[int], dtype: torch.dtype, pin: bool) -> None:
        self.flat = torch.zeros(max(sum(sizes), 1), dtype=dtype)
        self.pinned = pin and _register(self.flat)
        if self.pinned:  # unpinning memory still viewed elsewhere only makes it pageable: safe
            weakref.finalize(self, _unregister, self.flat.data_ptr())
        self.views: list[torch.Tensor] = []
        offset = 0
        for n in sizes:
            self.views.append(self.flat[offset:offset + n])
            offset += n

    @property
    def nbytes(self) -> int:
        return self.flat.untyped_storage().nbytes()


class HostBackend:
    """The optimizer side of offloaded units in host memory: masters in one page-locked arena (the optimizer
    creates its state next to them), a chunk stepped where it lies.

    The same small interface as :class:`lightning_zero.engine.swap.NvmeBackend`: ``chunks`` groups units
    into steps of ``HOST_STEP_CHUNK`` elements, ``run`` gives each chunk to ``body`` (here in place).
    """

    steps_in_place = True  # the overlap worker may step a unit as soon as its gradient landed

    def __init__(self, units: Sequence[FlatUnit], pin: bool) -> None:
        self.arena = HostArena([u.layout.shard_numel for u in units], torch.float32, pin)
        for unit, host in zip(units, self.arena.views):
            host.copy_(unit.master)
            unit.set_master(host)

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes

    def chunks(self, units: Sequence[FlatUnit]) -> list[list[FlatUnit]]:
        return [[units[i] for i in chunk] for chunk in chunk_units([u.layout.shard_numel for u in units],
                                                                   HOST_STEP_CHUNK)]

    def run(self, optimizer: torch.optim.Optimizer, chunks: list[list[FlatUnit]],
            body: Callable[[list[FlatUnit]], Optional[Any]]) -> None:
        for chunk in chunks:
            body(chunk)

    def close(self) -> None:
        pass
