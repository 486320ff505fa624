"""What is really alive in a rank's process: distinct CPU tensor storages found by ``gc`` (plus the
module's parameter gradients, which live in autograd's C++ side until Python reads them)."""

from __future__ import annotations

import gc
from collections.abc import Iterable

import torch


def live_storages(extra: Iterable[torch.Tensor] = ()) -> dict[int, int]:
    """data_ptr -> bytes of every distinct live CPU storage."""
    gc.collect()
    out: dict[int, int] = {}
    for t in [*extra, *(o for o in gc.get_objects() if isinstance(o, torch.Tensor))]:
        if t is not None and t.device.type == "cpu":
            storage = t.untyped_storage()
            if storage.nbytes():
                out[storage.data_ptr()] = storage.nbytes()
    return out


def split_host(storages: dict[int, int], host_tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(bytes of the storages holding ``host_tensors``, bytes of all the others)."""
    host = {t.untyped_storage().data_ptr() for t in host_tensors if t is not None}
    inside = sum(n for ptr, n in storages.items() if ptr in host)
    return inside, sum(storages.values()) - inside
