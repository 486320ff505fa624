"""A user's in-place edits of the published parameter values, taken into the fp32 masters (see [Note: edits of
published values] in :mod:`lightning_zero.engine.flat_unit`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from .flat_unit import FlatUnit, ReplacedParameterError

__all__ = ["absorb_edits", "EditWatch"]


@torch.no_grad()
def absorb_edits(units: Sequence[FlatUnit], comparable: Callable[[FlatUnit], bool],
                 marked: Callable[[FlatUnit], bool] = lambda unit: False,
                 unreachable: Callable[[FlatUnit], bool] = lambda unit: False) -> None:
    """Every unit's placeholders are checked; the ``comparable`` ones compare their published values with their
    master chunk by chunk, the ``marked`` ones (masters on the host) with the fingerprints taken at their publish,
    with one host sync for all flags, and take the changed chunks."""
    chunks = []
    for unit in units:
        take_replaced_data(unit, comparable(unit) or marked(unit), unreachable(unit))
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


def take_replaced_data(unit: FlatUnit, writable: bool, unreachable: bool = False) -> None:
    """Parameters given new data (``p.data = ...``) since the last look: their values become the unit's (see [Note:
    replaced parameter data] in :mod:`lightning_zero.engine.flat_unit`). A unit whose master cannot be written now
    (offloaded, the host may be stepping it) keeps them for a later look; one whose master is never written from the
    parameters (NVMe files, delayed_step) cannot take them: an error, since the forward would use values the
    optimizer never sees."""
    slots = unit.replaced()
    if slots and unreachable:
        raise ReplacedParameterError(
            f"Parameter {unit.names[slots[0]]!r} was given new data (`p.data = ...`), but its fp32 master is offloaded "
            f"with NVMe or delayed_step, where values written into the parameters are not taken. Set the values before "
            f"the Trainer starts, load them from a checkpoint, or offload with offload_optimizer='cpu' and "
            f"delayed_step=False.")
    if slots and writable:
        unit.take_replaced(slots)


class EditWatch:
    """Where the engine looks for edits. Units with a device master: compared whole, anywhere. Units whose master is
    offloaded to the CPU (``host``: their indices; ``reachable``: not NVMe files, not delayed_step, whose host master
    runs a step ahead by design): compared whole outside the step (the host may be stepping them inside it), through
    the fingerprints of their last publish before backward and at a step whose host work did not start during
    backward. Holds the units only (the engine passes the rest: no reference back to it)."""

    def __init__(self, units: Sequence[FlatUnit]) -> None:
        self.units = units

    def absorb(self, host: Collection[int], reachable: bool, offloaded_too: bool = True, marked: bool = False) -> None:
        absorb_edits(self.units, lambda unit: unit.index not in host or (offloaded_too and reachable),
                     lambda unit: marked and reachable and unit.index in host,
                     lambda unit: not reachable and unit.index in host)

    def take_replaced(self, host: Collection[int], reachable: bool) -> None:
        """Only the parameters given new data (``p.data = t``), before a forward: from there it computes with what
        the optimizer will step, and a wrong shape is named before it fails somewhere in the forward."""
        for unit in self.units:
            take_replaced_data(unit, unit.index not in host or reachable, unit.index in host and not reachable)

    def absorb_unit(self, unit: FlatUnit, host: Collection[int], reachable: bool) -> None:
        """One gathered unit's edits (a forward changed its parameters in place), before it is freed."""
        absorb_edits([unit], lambda u: u.index not in host or reachable)

    def mark_published(self, host: Collection[int], reachable: bool) -> None:
        """After a step: the fingerprints of what the offloaded units published."""
        if reachable:
            for unit in self.units:
                if unit.index in host:
                    unit.mark_published()
