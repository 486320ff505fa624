"""A user's in-place edits of the published parameter values, taken into the fp32 masters (see [Note: edits of
published values] in :mod:`lightning_zero.engine.flat_unit`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .flat_unit import FlatUnit

__all__ = ["absorb_edits"]


@torch.no_grad()
def absorb_edits(units: Sequence[FlatUnit], comparable: Callable[[FlatUnit], bool],
                 marked: Callable[[FlatUnit], bool] = lambda unit: False) -> None:
    """Every unit's placeholders are checked; the ``comparable`` ones compare their published values with their
    master chunk by chunk, the ``marked`` ones (masters on the host) with the fingerprints taken at their publish,
    with one host sync for all flags, and take the changed chunks."""
    chunks = []
    for unit in units:
        unit.check_placeholders()
        if comparable(unit):
            chunks += [(unit, lo, hi, flag) for lo, hi, flag in unit.edit_flags()]
        elif marked(unit):
            chunks += [(unit, lo, hi, flag) for lo, hi, flag in unit.marked_edit_flags()]
    if not chunks:
        return
    changed = torch.stack([flag for _, _, _, flag in chunks]).tolist()
    touched = {}
    for (unit, lo, hi, _), edited in zip(chunks, changed):
        if edited:
            unit.take_edits(lo, hi)
            touched[unit.index] = unit
    for unit in touched.values():
        unit.refresh_param_shard()  # stage 3 with offload gathers from this compute-dtype copy
        if marked(unit):
            unit.mark_published()  # what it publishes now includes the edit
