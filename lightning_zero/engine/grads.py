"""The gradient path: hooks copy ready gradients into unit buffers and reduce-scatter them.

[Note: readiness]
Before a backward the reducer learns which parameters will get a gradient (see
:mod:`lightning_zero.engine.readiness`); a unit is ready once those have arrived, so frozen,
unused and unreached parameters are never waited for. Units are launched in one order
agreed by every rank (rank 0's forward order), each as soon as it and those before it are
ready. In a one-rank world there is nothing to agree on: each unit goes when ready.

[Note: late gradients]
A gradient that arrives after its unit was reduced (a misprediction: a parameter hidden
from the graph) is kept in ``param.grad`` and reduced at the end of the window, after the
window's one agreement collective says which units any rank has late gradients for.

[Note: the window]
A window is the backwards between two optimizer steps. Closing it (``close_window``) waits
for every reduction and all-reduces one small flag vector: which parameters got a
gradient on any rank (the others keep ``grad is None`` semantics: no step, no state
change, as DDP with ``find_unused_parameters``) and which units have late gradients.

[Note: bounded memory]
At most ``max_inflight`` full-size gradient buffers wait on a collective; launching one
more first completes the oldest, and so does starting a new buffer while ``max_inflight``
others are alive (in flight or still filling), so stages 2/3 hold at most
``max_inflight`` + 1 full-size gradient buffers whatever order gradients arrive in. Stages 2/3 free a buffer once its shard is accumulated
in the fp32 ``grad_shard``; stage 1 keeps its buffer (in ``accum_dtype``) for the window.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
from torch.profiler import record_function

from ..collectives import Comm, Handle
from ..config import ZeroConfigError
from .flat_unit import FlatUnit
from .readiness import reached_leaves
from .schedule_check import out_of_step
from .supported import SPARSE_GRADIENT
from .weak import weakly

__all__ = ["GradientReducer", "ReducePolicy"]


@dataclass(frozen=True)
class ReducePolicy:
    """How gradients are reduced (from ZeroConfig and the precision).

    Args:
        shard_grads: stage >= 2: reduce every micro-batch; False (stage 1) accumulates full
            gradients through the window and reduces at its last backward.
        overlap: True: a reduction runs while backward goes on; False: it is waited for at once
            (no overlap, but still issued as soon as its unit is ready, so memory stays bounded).
        reduce_dtype: dtype of the reduce-scatter.
        accum_dtype: dtype stage 1 accumulates full gradients in.
        max_inflight: full-size buffers allowed to wait on a collective at once.
    """

    shard_grads: bool
    overlap: bool
    reduce_dtype: torch.dtype
    accum_dtype: torch.dtype
    max_inflight: int = 2


class GradientReducer:
    """Owns the gradient hooks and the reduce-scatter schedule of ``units``.

    Args:
        units: every unit, indexed by position.
        comm: collectives for the data-parallel group.
        policy: see :class:`ReducePolicy`.
        agree_order: called at the first backward; returns the launch order (unit indices)
            every rank uses, or None to keep index order.
        on_backward_end: called once each backward has finished.
        sink: ``sink(unit, reduced, last_micro_batch, unscale)`` takes each reduced chunk instead of
            the unit's gradient shard (offload).
    """

    def __init__(self, units: list[FlatUnit], comm: Comm, policy: ReducePolicy,
                 agree_order: Optional[Callable[[], Optional[list[int]]]] = None,
                 on_backward_end: Optional[Callable[[], None]] = None,
                 sink: Optional[Callable[[FlatUnit, torch.Tensor, bool, float], None]] = None) -> None:
        self.units = units
        self.comm = comm
        self.policy = policy
        self.order = list(range(len(units)))
        self._agree_order = agree_order
        self.on_backward_end = on_backward_end
        self.sink = sink  # takes each reduced chunk (offload moves it to the host); None: the unit's grad shard
        self.on_late: Optional[Callable[[FlatUnit], None]] = None  # told of a late gradient (offload overlap)
        self.last_micro_batch = True  # False inside no_sync: a micro-batch before the last of its window
        self.grad_scale = 1.0  # the loss scale the gradients of this window carry (fp16; see precision.step)
        self._slot_of = {id(p): (u, i) for u in units for i, p in enumerate(u.params)}
        self._hooks: dict[int, object] = {}
        self.register_hooks()
        n = len(units)
        self._expect: list[set[int]] = [set() for _ in range(n)]  # per backward: slots still to arrive
        self._reducible = [False] * n
        self._launched = [False] * n
        self._written: list[set[int]] = [set() for _ in range(n)]  # slots holding a gradient in grad_full
        self._summed: set[int] = set()  # units whose grad_full added a second gradient into a slot
        self._cursor = 0
        self._in_backward = False
        self._inflight: deque = deque()
        self.window_open = False
        self._unreduced = False  # stage 1: a no_sync backward accumulated gradients not reduced yet
        self._used: list[set[int]] = [set() for _ in range(n)]  # per window, this rank
        self._late: dict[int, torch.Tensor] = {}  # id(param) -> param holding a late gradient
        self.window_full_bytes = 0  # stage 1: bytes of full gradient buffers the current window allocated
        # where reduce-scatters were issued: while backward still ran (overlapped) or once it ended
        self.launches = {"during_backward": 0, "after_backward": 0}
        self.trace: Optional[list] = None  # set to a list to record (time, "launch"|"done", unit index)

    @property
    def in_backward(self) -> bool:
        """A backward was announced (``begin_backward``) or started and has not finished yet."""
        return self._in_backward

    @property
    def _ordered(self) -> bool:
        return self.comm.world_size > 1 or self.comm.force

    @property
    def reduces_now(self) -> bool:
        return self.last_micro_batch or self.policy.shard_grads

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stage 1: accumulate full gradients locally; stage 2/3 still reduce (their memory promise)."""
        self.last_micro_batch = False
        try:
            yield
        finally:
            self.last_micro_batch = True

    def tell_late(self, on_late: Optional[Callable[[FlatUnit], None]]) -> None:
        """Who to tell of a late gradient (the offload overlap, which must not have stepped its unit)."""
        self.on_late = on_late

    def set_grad_scale(self, scale: float) -> None:
        """The loss scale the coming backward's gradients carry (fp16): chunks are stored divided by it."""
        self.grad_scale = float(scale)

    def used_slots(self, unit: FlatUnit) -> set[int]:
        """Slots of ``unit`` that got a gradient on this rank in the open window."""
        return self._used[unit.index]

    # ---- hooks ----------------------------------------------------------------------------
    def register_hooks(self) -> None:
        """Hook every parameter that needs a gradient now (parameters unfrozen later are hooked then).

        A parameter's hook is held by its gradient accumulator, on the C++ side of autograd, where
        Python's garbage collector cannot see it: a hook that held the reducer would keep the reducer,
        its units, their parameters and so the whole model alive after the user dropped them (every
        stage-3 fit in a loop would leak one). The hook holds the reducer weakly.
        """
        hook = weakly(self._on_grad)
        for unit in self.units:
            for param in unit.params:
                if param.requires_grad and id(param) not in self._hooks:
                    self._hooks[id(param)] = param.register_post_accumulate_grad_hook(hook)

    def remove_hooks(self) -> None:
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()

    def begin_backward(self, roots: Sequence[torch.Tensor]) -> None:
        """Called with the loss before ``backward()``: read what will arrive off the graph."""
        self.register_hooks()
        leaves, opaque = reached_leaves(roots)
        self._start(lambda p: p.requires_grad and (opaque or id(p) in leaves))
        root = next((r for r in roots if isinstance(r, torch.Tensor) and r.grad_fn is not None), None)
        if root is None:
            return
        handle = None

        def started(*_: object) -> None:  # runs inside the outer backward: queue its end there
            handle.remove()
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

        handle = root.grad_fn.register_prehook(started)

    def _start(self, expected: Callable[[torch.Tensor], bool]) -> None:
        if self._agree_order is not None:
            order, self._agree_order = self._agree_order(), None
            if order is not None:
                self.order = order
        self._in_backward = True
        if not self.window_open:
            self.window_full_bytes = 0
        self.window_open = True
        self._cursor = 0
        for unit in self.units:
            k = unit.index
            self._reducible[k] = any(p.requires_grad for p in unit.params)
            self._expect[k] = {i for i, p in enumerate(unit.params) if expected(p)}
            self._launched[k] = False

    @torch.no_grad()
    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._in_backward:  # backward() without begin_backward(): expect every trainable parameter
            self._start(lambda p: p.requires_grad)
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
        self._take(param)

    def _take(self, param: torch.Tensor) -> None:
        unit, slot = self._slot_of[id(param)]
        k = unit.index
        self._used[k].add(slot)
        if self._launched[k] and self.reduces_now:
            if self.on_late is not None:
                self.on_late(unit)
            self._late[id(param)] = param  # see [Note: late gradients]
            return
        self._accumulate(unit, slot, param.grad)
        param.grad = None
        self._late.pop(id(param), None)
        if not self.reduces_now:
            self._unreduced = True
            return
        self._expect[k].discard(slot)
        if self._ordered:
            self._launch_in_order(during_backward=True)
        elif not self._expect[k]:
            self._launch(unit, during_backward=True)

    def _accumulate(self, unit: FlatUnit, slot: int, grad: torch.Tensor) -> None:
        if grad.layout != torch.strided:  # F.embedding(sparse=True): check_supported sees only the modules
            raise ZeroConfigError(SPARSE_GRADIENT.format(what=f"'{unit.names[slot]}'"))
        if unit.grad_full is None:
            if self.policy.shard_grads:
                self._make_room()
            unit.start_grad_full(self.policy.reduce_dtype if self.policy.shard_grads else self.policy.accum_dtype)
            self._written[unit.index].clear()
            if not self.policy.shard_grads:
                self.window_full_bytes += unit.grad_full.untyped_storage().nbytes()
        s = unit.layout.slots[slot]
        target = unit.grad_full[s.offset:s.end]
        if slot in self._written[unit.index]:
            target.add_(grad.reshape(-1))
            self._summed.add(unit.index)
        else:
            target.copy_(grad.reshape(-1))
            self._written[unit.index].add(slot)

    def _make_room(self) -> None:
        """Before a new full-size buffer: at most ``max_inflight`` others may be alive, filling or in
        flight (a unit still waiting for a late gradient, e.g. a stem registered among the last
        layers, counts too), so the oldest reduction completes first."""
        filling = sum(1 for u in self.units if u.grad_full is not None)
        while self._inflight and filling + len(self._inflight) > self.policy.max_inflight:
            self._complete(*self._inflight.popleft())

    def _launch_in_order(self, during_backward: bool) -> None:
        while self._cursor < len(self.order):
            unit = self.units[self.order[self._cursor]]
            if self._expect[unit.index] and during_backward:
                return
            self._cursor += 1
            self._launch(unit, during_backward)

    # ---- collectives --------------------------------------------------------------------------
    def _launch(self, unit: FlatUnit, during_backward: bool = False) -> None:
        k = unit.index
        if self._launched[k]:
            return
        self._launched[k] = True
        if not self._reducible[k]:
            return
        self.launches["during_backward" if during_backward else "after_backward"] += 1
        self._trace("launch", k)
        self._reduce(unit, unit.take_grad_full(), self._written[k])

    def _reduce(self, unit: FlatUnit, full: Optional[torch.Tensor], written: set[int]) -> None:
        """Reduce-scatter ``full`` (slots outside ``written`` are zeroed) into the unit's gradient shard."""
        if full is None:
            full = torch.zeros(unit.layout.padded_numel, dtype=self.policy.reduce_dtype, device=unit.device)
        else:
            for slot_index, slot in enumerate(unit.layout.slots):
                if slot_index not in written:
                    full[slot.offset:slot.end].zero_()
        written.clear()
        summed = unit.index in self._summed
        self._summed.discard(unit.index)
        if not self._ordered:  # one rank: the buffer is the shard, in whatever dtype it accumulated
            out, handle = full, Handle()
        else:
            with record_function(f"zero/reduce_scatter[unit {unit.index}]"):
                # [Note: sums in fp16] Pre-divide, as DDP does, before any cast: 16-bit sums stay in range. A buffer
                # that summed several backwards in fp32 (stage 1's window) may hold more than fp16 can, where each
                # backward's gradient fitted (DDP and stage 2 keep such sums in fp32): it is reduced in fp32.
                dtype = self.policy.reduce_dtype
                if summed and dtype == torch.float16 and full.dtype == torch.float32:
                    dtype = torch.float32
                full.div_(self.comm.world_size)
                send = full if full.dtype == dtype else full.to(dtype)
                out = torch.empty(unit.layout.shard_numel, dtype=send.dtype, device=send.device)
                handle = self.comm.reduce_scatter(out, send, async_op=True)
        if not self.policy.overlap:
            self._complete(unit, out, handle)
            return
        while len(self._inflight) >= self.policy.max_inflight:
            self._complete(*self._inflight.popleft())
        self._inflight.append((unit, out, handle))

    def _complete(self, unit: FlatUnit, out: torch.Tensor, handle: Handle) -> None:
        with record_function(f"zero/reduce_wait[unit {unit.index}]"):
            try:
                handle.wait()
            except RuntimeError as err:
                raise out_of_step("gradient reduce-scatter", unit.names) from err
        unscale = 1.0 / self.grad_scale
        if self.sink is not None:
            self.sink(unit, out, self.last_micro_batch, unscale)
        else:
            unit.add_to_grad_shard(out, unscale)
        self._trace("done", unit.index)

    def _trace(self, what: str, unit_index: int) -> None:
        if self.trace is not None:
            self.trace.append((time.perf_counter(), what, unit_index))

    def abandon(self) -> None:
        """Forget the reductions in flight without waiting (after an error on this rank)."""
        self._inflight.clear()
        self._in_backward = False

    def wait_all(self) -> None:
        while self._inflight:
            self._complete(*self._inflight.popleft())

    @torch.no_grad()
    def finish_backward(self) -> None:
        """End of a backward: take gradients no hook delivered, launch what is left, wait.

        Also called by the caller when no hook fired at all (``in_backward`` still True after
        the backward): every rank must still issue the same collectives.
        """
        if not self._in_backward:
            self._start(lambda p: False)
        for unit in self.units:  # parameters unfrozen after the last begin_backward have no hook yet
            for param in unit.params:
                if param.grad is not None and id(param) not in self._late:
                    self._take(param)
        if self.reduces_now:
            if self._ordered:
                self._launch_in_order(during_backward=False)
            else:
                for unit in self.units:
                    self._launch(unit)
            self._unreduced = False
        self.wait_all()
        self._in_backward = False
        if self.on_backward_end is not None:
            self.on_backward_end()

    # ---- the window ---------------------------------------------------------------------------
    @torch.no_grad()
    def close_window(self) -> Optional[list[set[int]]]:
        """Finish the window (one small collective); returns, per unit, the slots any rank used.

        None when the window was already closed (a second optimizer after the same backward).
        """
        if not self.window_open:
            return None
        if self._unreduced:  # stage 1 stepped right after no_sync backwards: reduce them now
            for k in self.order:
                self._launched[k] = False
                self._reducible[k] = any(p.requires_grad for p in self.units[k].params)
                self._launch(self.units[k])
            self._unreduced = False
        self.wait_all()
        used, late = self._agree()
        for unit in self.units:
            if late[unit.index]:
                self._reduce_late(unit)
        self.wait_all()
        for s in self._used:
            s.clear()
        self.window_open = False
        return used

    def _agree(self) -> tuple[list[set[int]], list[bool]]:
        sizes = [len(u.params) for u in self.units]
        flags = torch.zeros(sum(sizes) + len(self.units), dtype=torch.float32)
        offset = 0
        late_units = {self._slot_of[pid][0].index for pid in self._late}
        for unit, size in zip(self.units, sizes):
            for slot in self._used[unit.index]:
                flags[offset + slot] = 1.0
            offset += size
        for k in late_units:
            flags[offset + k] = 1.0
        if self._ordered:
            device = self.units[0].device if self.units else torch.device("cpu")
            flags = self.comm.all_reduce(flags.to(device), op="max").cpu()
        values = flags.tolist()
        used, offset = [], 0
        for size in sizes:
            used.append({i for i in range(size) if values[offset + i] > 0})
            offset += size
        return used, [v > 0 for v in values[offset:]]

    def _reduce_late(self, unit: FlatUnit) -> None:
        full = torch.zeros(unit.layout.padded_numel, dtype=self.policy.reduce_dtype, device=unit.device)
        written: set[int] = set()
        for slot, param in enumerate(unit.params):
            if id(param) in self._late:
                del self._late[id(param)]
                s = unit.layout.slots[slot]
                full[s.offset:s.end].copy_(param.grad.reshape(-1))
                param.grad = None
                written.add(slot)
        self._reduce(unit, full, written)
