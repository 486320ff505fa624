"""The host step during backward: a worker that schedules offloaded units as their gradients land.

Units whose final gradient was copied to the host queue up; every ``HOST_STEP_CHUNK`` elements
the worker waits for their copies and hands them to the offloader's one host step
(:meth:`lightning_zero.engine.offload.Offloader.step_units`), publishing their new values on the
upload stream beside backward's kernels. Units some of whose trainable parameters got no gradient
on this rank are left to the regular step (whether another rank used them is only agreed at the
window's end). ``drain`` steps what is queued and waits; it returns the units stepped.

Speculative (clipping or fp16 loss scaling, see :mod:`lightning_zero.engine.speculation`): the worker
first unscales each unit's host gradient by the factor the offloader handed over with it, copies the
unit's master and state aside, then steps; ``reject`` puts units back as they were before the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from .flat_unit import FlatUnit
from .host import HOST_STEP_CHUNK
from .speculation import Backups

if TYPE_CHECKING:
    from .offload import Offloader

__all__ = ["OverlapWorker"]


class OverlapWorker:
    """Schedules host steps of ``optimizer``'s offloaded units while backward runs.

    Args:
        owner: the offloader whose ``step_units`` does the stepping.
        optimizer: the one optimizer (the strategy allows the overlap only then).
        inner: the optimizer's own step.
        fully_used: whether every trainable parameter of a unit got a gradient on this rank.
        publish_own: copies a unit's new values to the device (its own chunk; the others come at the step).
        speculative: something may still change the gradients before the step (clipping, the fp16 overflow
            vote): keep what each step overwrote, to undo it (``reject``).
    """

    def __init__(self, owner: Offloader, optimizer: torch.optim.Optimizer, inner: Callable[[], Any],
                 fully_used: Callable[[FlatUnit], bool], publish_own: Callable[[list[FlatUnit]], None],
                 speculative: bool = False) -> None:
        self.owner, self.optimizer, self.inner = owner, optimizer, inner
        self.fully_used, self.publish_own = fully_used, publish_own
        self.backups: Backups | None = Backups() if speculative else None
        self.mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lz-host-step")
        self.queued: list[tuple[FlatUnit, Any, float]] = []
        self.queued_numel = 0
        self.futures: list[Future] = []
        self.stepped: set[int] = set()
        self.barred: set[int] = set()  # units with a late gradient this window: left to the regular step

    @property
    def speculative(self) -> bool:
        return self.backups is not None

    def accepts(self, unit: FlatUnit) -> bool:
        return (unit.index not in self.barred and self.fully_used(unit)
                and all(id(p) in self.mine for p in unit.params if p.requires_grad))

    def ready(self, unit: FlatUnit, event: Any, unscale: float = 1.0) -> None:
        """``unit``'s final gradient is on its way to the host (``event``); the worker multiplies it by
        ``unscale`` (speculative: the offloader left that to the worker) before stepping it."""
        self.queued.append((unit, event, unscale))
        self.queued_numel += unit.layout.shard_numel
        # a full chunk amortizes the optimizer call; an idle worker starts at once (the first unit of a window
        # would otherwise wait for the next to land: tens of ms of host time lost on large units)
        if self.queued_numel >= HOST_STEP_CHUNK or all(f.done() for f in self.futures):
            self._submit()
            self.owner.batches_in_backward += 1  # submitted while backward still runs, not at the drain

    def _submit(self) -> None:
        batch, self.queued, self.queued_numel = self.queued, [], 0
        if batch:
            self.stepped.update(u.index for u, _, _ in batch)
            self.futures.append(self.pool.submit(self._step, batch))

    def _step(self, batch: list[tuple[FlatUnit, Any, float]]) -> None:
        start = time.perf_counter()
        try:
            units = [u for u, _, _ in batch]
            with torch.no_grad():
                for unit, event, unscale in batch:
                    if event is not None:
                        event.synchronize()
                    if unscale != 1.0:  # the same multiply finish_window would do
                        unit.grad_shard.mul_(unscale)
                for unit in units:  # the pieces' gradients: what finish_grads gives them at the window's end
                    for slot, param in enumerate(unit.params):
                        if param.requires_grad:
                            unit.give_grad(slot)
                if self.backups is not None:
                    self.backups.save(self.optimizer, units)
                self.owner.step_units(self.optimizer, self.inner, units, self._publish, label="host_step_in_backward")
        finally:
            self.owner.seconds["host_step"] += time.perf_counter() - start

    def _publish(self, units: list[FlatUnit]) -> None:
        stream = self.owner.up_stream
        if stream is None:
            self.publish_own(units)
            return
        with torch.cuda.stream(stream):  # beside backward's kernels; the step's end makes compute wait for it
            self.publish_own(units)

    def wait(self) -> None:
        """Step what is still queued and wait for every batch (the stepped units stay recorded)."""
        self._submit()
        start = time.perf_counter()
        futures, self.futures = self.futures, []
        for future in futures:
            future.result()
        self.owner.seconds["wait_for_host"] += time.perf_counter() - start

    def drain(self) -> set[int]:
        """Step what is still queued, wait for every batch; the indices of the units stepped this window
        (their speculative steps, if any, now stand)."""
        self.wait()
        if self.owner.up_stream is not None:
            torch.cuda.current_stream(self.owner.device).wait_stream(self.owner.up_stream)
        stepped, self.stepped = self.stepped, set()
        self.barred.clear()
        self.owner.stepped_in_backward += len(stepped)
        if self.backups is not None:
            self.backups.forget()
        return stepped

    def reject(self, units: list[FlatUnit]) -> list[FlatUnit]:
        """Undo the speculative steps of those of ``units`` stepped this window; returns the units undone
        (the regular step steps them again, or the skip leaves them as they were)."""
        if self.backups is None:
            return []
        self.wait()
        if self.owner.up_stream is not None:  # the worker's uploads of the values being undone have run
            torch.cuda.current_stream(self.owner.device).wait_stream(self.owner.up_stream)
        undone = self.backups.restore(self.optimizer, [u for u in units if u.index in self.stepped])
        self.stepped.difference_update(u.index for u in undone)
        self.owner.speculations_undone += len(undone)
        return undone

    def close(self) -> None:
        self.drain()
        self.pool.shutdown(wait=True)
        if self.backups is not None:
            self.backups.close()

    def late_gradient(self, unit: FlatUnit) -> None:
        """``unit`` got a gradient after it was handed over: still queued, it goes back to the regular step (which
        sees the whole gradient); already stepped, the run cannot be exact."""
        if unit.index not in self.stepped:
            self.barred.add(unit.index)  # its reduction may still be landing: it must not be queued then
            if any(entry[0] is unit for entry in self.queued):
                self.queued = [entry for entry in self.queued if entry[0] is not unit]
                self.queued_numel -= unit.layout.shard_numel
            return
        if unit.index in self.stepped:
            raise RuntimeError(
                f"lightning_zero offload: parameters {unit.names[:3]} received a gradient after their unit had "
                f"been stepped during backward (a parameter whose gradient arrives twice in one backward, e.g. "
                f"under reentrant activation checkpointing). Set ZeroConfig(overlap_step=False).")
