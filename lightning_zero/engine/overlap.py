"""The host step during backward: a worker that schedules offloaded units as their gradients land.

Units whose final gradient was copied to the host queue up; every ``HOST_STEP_CHUNK`` elements
the worker waits for their copies and hands them to the offloader's one host step
(:meth:`lightning_zero.engine.offload.Offloader.step_units`), publishing their new values on the
upload stream beside backward's kernels. Units some of whose trainable parameters got no gradient
on this rank are left to the regular step (whether another rank used them is only agreed at the
window's end). ``drain`` steps what is queued and waits; it returns the units stepped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from .flat_unit import FlatUnit
from .host import HOST_STEP_CHUNK

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
    """

    def __init__(self, owner: Offloader, optimizer: torch.optim.Optimizer, inner: Callable[[], Any],
                 fully_used: Callable[[FlatUnit], bool], publish_own: Callable[[list[FlatUnit]], None]) -> None:
        self.owner, self.optimizer, self.inner = owner, optimizer, inner
        self.fully_used, self.publish_own = fully_used, publish_own
        self.mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lz-host-step")
        self.queued: list[tuple[FlatUnit, Any]] = []
        self.queued_numel = 0
        self.futures: list[Future] = []
        self.stepped: set[int] = set()

    def ready(self, unit: FlatUnit, event: Any) -> None:
        if not self.fully_used(unit) or not all(id(p) in self.mine for p in unit.params if p.requires_grad):
            return
        self.queued.append((unit, event))
        self.queued_numel += unit.layout.shard_numel
        if self.queued_numel >= HOST_STEP_CHUNK:
            self._submit()
            self.owner.batches_in_backward += 1  # submitted while backward still runs, not at the drain

    def _submit(self) -> None:
        batch, self.queued, self.queued_numel = self.queued, [], 0
        if batch:
            self.stepped.update(u.index for u, _ in batch)
            self.futures.append(self.pool.submit(self._step, batch))

    def _step(self, batch: list[tuple[FlatUnit, Any]]) -> None:
        start = time.perf_counter()
        try:
            for _, event in batch:
                if event is not None:
                    event.synchronize()
            units = [u for u, _ in batch]
            for unit in units:  # the pieces' gradients: what finish_grads gives them at the window's end
                for slot, param in enumerate(unit.params):
                    if param.requires_grad:
                        unit.give_grad(slot)
            with torch.no_grad():
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

    def drain(self) -> set[int]:
        """Step what is still queued, wait for every batch; the indices of the units stepped this window."""
        self._submit()
        start = time.perf_counter()
        for future in self.futures:
            future.result()
        self.owner.seconds["wait_for_host"] += time.perf_counter() - start
        self.futures.clear()
        if self.owner.up_stream is not None:
            torch.cuda.current_stream(self.owner.device).wait_stream(self.owner.up_stream)
        stepped, self.stepped = self.stepped, set()
        self.owner.stepped_in_backward += len(stepped)
        return stepped

    def late_gradient(self, unit: FlatUnit) -> None:
        if unit.index in self.stepped:
            raise RuntimeError(
                f"lightning_zero offload: parameters {unit.names[:3]} received a gradient after their unit had "
                f"been stepped during backward (a parameter whose gradient arrives twice in one backward, e.g. "
                f"under reentrant activation checkpointing). Set ZeroConfig(overlap_step=False).")
