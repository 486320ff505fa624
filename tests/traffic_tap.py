"""Count what really crosses ``torch.distributed``: every ProcessGroup collective, whoever calls it.

``Comm`` counts the bytes of the collectives it issues; this tap, installed on torch's ProcessGroup
class itself, sees every collective any code issues (ours, Lightning's, torch's), so a test can
check that nothing moved data behind ``Comm``'s back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

_OPS = ("_allgather_base", "_reduce_scatter_base", "all_gather_single", "reduce_scatter_single", "allgather",
        "allgather_coalesced", "allgather_into_tensor_coalesced", "allreduce", "allreduce_coalesced", "broadcast",
        "gather", "reduce", "reduce_scatter", "scatter", "send", "recv", "reduce_scatter_tensor_coalesced",
        "all_gather_single_coalesced", "reduce_scatter_single_coalesced")


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []


@contextmanager
def tap() -> Iterator[Counter]:
    """Yields op name -> bytes (per call, the largest tensor it touched: the full-size side of a collective)."""
    moved: Counter = Counter()
    saved = {}
    for name in _OPS:
        original = getattr(dist.ProcessGroup, name, None)
        if original is None:
            continue
        saved[name] = original

        def wrapper(self, *args, _name=name, _original=original, **kwargs):
            sizes = [t.numel() * t.element_size() for t in _tensors(list(args) + list(kwargs.values()))]
            moved[_name] += max(sizes, default=0)
            return _original(self, *args, **kwargs)

        setattr(dist.ProcessGroup, name, wrapper)
    try:
        yield moved
    finally:
        for name, original in saved.items():
            setattr(dist.ProcessGroup, name, original)
