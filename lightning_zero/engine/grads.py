"""The gradient path: hooks copy ready gradients into unit buffers and reduce-scatter them.

[Note: launch order]
Collectives must be issued in the same order on every rank, whatever order autograd
happens to produce gradients in. Units therefore launch strictly by index: a unit whose
gradients are complete waits until every unit before it has launched. Units are indexed
in the order backward is expected to finish them (reverse parameter order), so in the
usual case each launches as soon as it is ready, while backward continues (overlap).
Units that got no gradient in a backward (unused or frozen parameters) are launched, with
zeros, when backward ends, so every rank still issues the same sequence.

[Note: bounded memory]
At most ``max_inflight`` full-size gradient buffers wait on a collective; launching one
more first completes the oldest. Stage 2/3 free a buffer once its shard is accumulated.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Optional

import torch

from ..collectives import Comm, Handle
from .flat_unit import FlatUnit

__all__ = ["GradientReducer"]


class GradientReducer:
    """Owns the hooks and the reduce-scatter schedule of a list of units.

    Args:
        units: every unit with trainable parameters, in launch order.
        comm: collectives for the data-parallel group.
        shard_grads: stage >= 2: reduce every micro-batch and free the full buffers;
            False (stage 1) keeps full gradients and reduces only when ``sync`` is on.
        overlap: launch while backward runs (True) or only once it has ended.
        on_unit_reduced: called with each unit after its gradients are reduced (stage 3
            uses it to free the gathered parameters).
        on_backward_end: called once a backward has finished (stage 3 frees what is left).
        max_inflight: full-size buffers allowed to wait on a collective at once.
    """

    def __init__(self, units: list[FlatUnit], comm: Comm, shard_grads: bool, overlap: bool,
                 on_unit_reduced: Optional[Callable[[FlatUnit], None]] = None,
                 on_backward_end: Optional[Callable[[], None]] = None, max_inflight: int = 2) -> None:
        self.units = units
        self.comm = comm
        self.shard_grads = shard_grads
        self.overlap = overlap
        self.on_unit_reduced = on_unit_reduced
        self.on_backward_end = on_backward_end
        self.max_inflight = max_inflight
        self.sync = True  # False inside block_backward_sync (honoured by stage 1 only)
        self._inflight: deque = deque()
        self._next = 0  # next unit index to launch in this backward
        self._in_backward = False
        self.finished_count = 0  # backward passes finished; lets a caller detect "no hook fired"
        # where reduce-scatters were issued: while backward still ran (overlapped) or once it ended
        self.launches = {"during_backward": 0, "after_backward": 0}
        self._hooks: list = []
        self._slot_of: dict[int, tuple[FlatUnit, int]] = {}
        for unit in units:
            for slot_index, param in enumerate(unit.params):
                self._slot_of[id(param)] = (unit, slot_index)
                if param.requires_grad:  # frozen now; if unfrozen later, finish_backward sweeps its grad in
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad))

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    @property
    def reduces_now(self) -> bool:
        return self.sync or self.shard_grads

    # ---- hooks ----------------------------------------------------------------------
    def _begin_backward(self) -> None:
        self._in_backward = True
        self._reset_pending()
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    @torch.no_grad()
    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._in_backward:
            self._begin_backward()
        unit, slot_index = self._slot_of[id(param)]
        if not unit.accepts_grads:
            param.grad = None
            return
        unit.add_grad(slot_index, param.grad)
        param.grad = None
        unit.pending -= 1
        if self.overlap and self.reduces_now:
            self._launch_ready(during_backward=True)

    def _launch_ready(self, during_backward: bool) -> None:
        while self._next < len(self.units) and self.units[self._next].pending <= 0:
            self._launch(self.units[self._next], during_backward)
            self._next += 1

    # ---- collectives ------------------------------------------------------------------
    def _launch(self, unit: FlatUnit, during_backward: bool = False) -> None:
        if not unit.trainable:
            return
        self.launches["during_backward" if during_backward else "after_backward"] += 1
        if unit.grad_full is None:
            unit.grad_full = unit.new_grad_buffer()
        for slot_index, slot in enumerate(unit.layout.slots):
            if slot_index not in unit.grad_written:
                unit.grad_full[slot.offset:slot.end].zero_()
        unit.grad_written.clear()
        full = unit.grad_full
        if self.comm.world_size == 1 and not self.comm.force:  # nothing to reduce: the buffer is the shard
            out, handle = full, Handle()
        else:
            full.div_(self.comm.world_size)  # pre-divide, as DDP does: keeps 16-bit sums in range
            out = torch.empty(unit.layout.shard_numel, dtype=full.dtype, device=full.device)
            handle = self.comm.reduce_scatter(out, full, async_op=True)
        if self.shard_grads or out is full:
            unit.grad_full = None  # the handle keeps the buffer alive until the collective is done
        while len(self._inflight) >= self.max_inflight:
            self._complete(*self._inflight.popleft())
        self._inflight.append((unit, out, handle))

    def _complete(self, unit: FlatUnit, out: torch.Tensor, handle: Handle) -> None:
        handle.wait()
        master = unit.master
        if master.grad is None:
            master.grad = out if out.dtype == torch.float32 else out.float()
        else:
            master.grad.add_(out)
        if self.on_unit_reduced is not None:
            self.on_unit_reduced(unit)

    @torch.no_grad()
    def finish_backward(self) -> None:
        """End of a backward pass: launch what is left (in order) and wait for everything.

        Also called when no hook fired (compare ``finished_count`` before and after a
        backward): a backward that reached none of the units on this rank must still issue
        the same collectives as on the other ranks.
        """
        if not self._in_backward:
            self._reset_pending()
        self.finished_count += 1
        self._sweep_unhooked_grads()
        if self.reduces_now:
            for unit in self.units[self._next:]:
                self._launch(unit)
            self._next = len(self.units)
        self.wait_all()
        self._in_backward = False
        if self.on_backward_end is not None:
            self.on_backward_end()

    def _sweep_unhooked_grads(self) -> None:
        for unit in self.units[self._next:]:
            for slot_index, param in enumerate(unit.params):
                if param.grad is not None and unit.accepts_grads:
                    unit.add_grad(slot_index, param.grad)
                    param.grad = None

    def _reset_pending(self) -> None:
        self._next = 0
        for unit in self.units:
            unit.pending = len(unit.trainable)

    def wait_all(self) -> None:
        while self._inflight:
            self._complete(*self._inflight.popleft())
