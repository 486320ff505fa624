"""Stage 3 runtime: gather a group's units for its forward and its backward, free them right after.

[Note: the life of a group]  (the model torch's FSDP2 uses)
- forward pre-hook: acquire the group's units (all-gather, or take a prefetch), prefetch
  the next ``prefetch`` groups in forward order and, when training, pass the tensor
  inputs through ``_PostBackward``.
- forward post-hook: release the units; hook the outputs so that backward acquires them
  again (pre-backward) and prefetches the previous groups.
- ``_PostBackward.backward`` runs once the gradients of the group's inputs exist. Autograd
  runs AccumulateGrad nodes as soon as they are ready, so the group's parameter gradients
  have been accumulated by then: the group is released there, whether or not its
  gradients have been reduced yet (the reducer owns its own buffers).
- end of backward: release what is still held (a group whose inputs need no gradient,
  such as the first one) and drop prefetches nobody used.
Units are reference counted: a unit needed by two groups (tied weights) stays gathered
while either holds it. Unused prefetches are bounded too: issuing one more than
``prefetch`` groups ahead drops the oldest. So at any moment what is gathered is the
running group, at most ``prefetch`` groups ahead, the root (held by the strategy for a
step), persistent small units, and a group whose layers run outside its forward.

[Note: recomputation]
Activation checkpointing runs forwards inside backward. Non-reentrant checkpointing
recomputes a group after its pre-backward acquired it: nothing to do. Reentrant
checkpointing ran the first forward without grad (no pre-backward was hooked), so its
recomputation acquires the group and releases it after the nested backward.

[Note: torch.compile]
The hooks are excluded from compilation, and the parameter objects and the storage of
``full`` never change (see :mod:`lightning_zero.engine.flat_unit`), so tensors a
compiled graph saved in forward are valid again once backward re-gathers their unit.

[Note: inference mode]
Storage and parameter data are set under ``inference_mode(False)``: a tensor touched
inside Lightning's ``inference_mode`` evaluation must stay usable by training afterwards.
"""

from __future__ import annotations

import enum
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import nn
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_map

from ..collectives import Comm, Handle
from .flat_unit import FlatUnit, UnitState
from .schedule_check import GatherScheduleCheck, out_of_step
from .weak import weakly

__all__ = ["Gatherer", "TrainingState", "UNSCOPED_FORWARD"]

UNSCOPED_FORWARD = ("A forward of the stage-3 module outside the trainer's steps (e.g. on rank 0 only after fit; its "
                    "parameters are sharded, so it gathers them from every rank)")


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class TrainingState(enum.Enum):
    """Where a group is in a training step (FSDP2's ``TrainingState``); transitions are checked."""

    IDLE = "idle"  # neither running nor held
    FORWARD = "forward"  # one or more of its forwards are running
    PRE_BACKWARD = "pre_backward"  # its backward has started: held (gathered) until it ends
    POST_BACKWARD = "post_backward"  # its backward has ended this step (IDLE again at the end of backward)


class _Call:
    """One forward call of a group module; its backward holds the group from pre- to post-backward."""

    __slots__ = ("_group", "held")

    def __init__(self, group: _Group) -> None:
        self._group = weakref.ref(group)  # the gatherer owns its groups; a graph that outlives it holds calls
        self.held = False

    @property
    def group(self) -> _Group:
        return self._group()


def _versions(unit: FlatUnit) -> list[int]:
    """The parameters' version counters: an in-place change through a parameter moves its own (see take_edits)."""
    return [p._version for p in unit.params]


class _UnitGather:
    """One unit's gather bookkeeping: who holds it, the all-gather in flight, the event to wait for."""

    __slots__ = ("unit", "holders", "pending", "ready", "versions")

    def __init__(self, unit: FlatUnit) -> None:
        self.unit = unit
        self.holders = 0
        self.versions: Optional[list[int]] = None  # the parameters' versions when they were pointed at the gather
        self.pending: Optional[Handle] = None  # all-gather in flight, not yet waited for
        self.ready: Optional[Any] = None  # CUDA event the compute stream waits for before use (side-stream copy)


class _Group:
    """A group module's state: its units, the forwards running, the calls whose backward holds it."""

    def __init__(self, module: nn.Module, units: list[FlatUnit]) -> None:
        self.module = module
        self.units = units
        self.state = TrainingState.IDLE
        self.forwards = 0  # its forwards running now (a module may call itself, or run inside a recompute)
        self.stack: list[Optional[_Call]] = []  # calls whose forward is running, innermost last
        self.held = 0  # calls whose backward holds the group

    def to(self, state: TrainingState) -> None:
        self.state = state

    def settle(self) -> None:
        """After one of its forwards ended: still running, held by a backward, or idle."""
        if self.forwards:
            self.state = TrainingState.FORWARD
        elif self.held:
            self.state = TrainingState.PRE_BACKWARD
        else:
            self.state = TrainingState.IDLE


class _PostBackward(torch.autograd.Function):
    """Identity on a group's inputs; its backward marks the end of the group's backward."""

    @staticmethod
    def forward(ctx: Any, gatherer: Gatherer, call: _Call, *inputs: torch.Tensor) -> tuple:
        ctx.gatherer, ctx.call = weakref.ref(gatherer), call  # weakly: see weak.py
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        gatherer = ctx.gatherer()
        if gatherer is not None:
            gatherer.post_backward(ctx.call)
        return (None, None) + grads


class Gatherer:
    """All-gathers and frees stage-3 units around the forward and backward of group modules.

    Args:
        needs: group module -> the units it must see gathered while it runs.
        comm: collectives for the data-parallel group.
        prefetch: groups ahead whose all-gather is issued early.
        persistent: indices of units that stay gathered (too small to be worth freeing).
        members: module owning parameters directly -> its group module (for layers run
            outside their group's forward, e.g. ``self.coder.encode(x)``).
        copy_stream: offload: the side stream host-to-device copies (and their gathers) run on.
        schedule: the check that every rank gathers the same units (see schedule_check).
        on_unscoped_forward: called before a forward that user code runs outside a step.
    """

    def __init__(self, needs: dict[nn.Module, list[FlatUnit]], comm: Comm, prefetch: int, persistent: set[int],
                 members: Optional[dict[nn.Module, nn.Module]] = None, copy_stream: Optional[Any] = None,
                 schedule: Optional[GatherScheduleCheck] = None, on_unscoped_forward: Optional[Any] = None) -> None:
        self.groups = {id(m): _Group(m, units) for m, units in needs.items()}
        self.schedule = schedule  # records every gather for the ranks' comparison (see schedule_check)
        # [Note: forwards outside a step] A forward that user code runs itself (after fit, under `if
        # trainer.is_global_zero:`) gathers too: a rank running it alone would wait in the all-gather until the
        # collective timeout. Outside a step (``scopes``: the strategy's step, the DeepSpeed-style forward) the
        # outermost group forward first calls ``on_unscoped_forward`` (a monitored barrier: a short, named error).
        self.scopes = 0
        self._running = 0  # group forwards running now (nested ones are inside the outermost)
        self.on_unscoped_forward = on_unscoped_forward
        self.on_forward_edit: Optional[Callable[[FlatUnit], None]] = None  # see post_forward
        self.comm = comm
        self.prefetch = prefetch
        self.persistent = persistent
        units = sorted({id(u): u for us in needs.values() for u in us}.values(), key=lambda u: u.index)
        self.slots = {u.index: _UnitGather(u) for u in units}
        self.order: list[_Group] = []  # groups in forward order (first training forward)
        self._order_frozen = False
        self._position: dict[int, int] = {}  # id(group module) -> place in ``order``
        self._prefetched: deque[list[FlatUnit]] = deque()  # issued ahead of use, oldest first
        self._calls: list[_Call] = []  # training forward calls of this backward
        self._held_until_backward_end: list[FlatUnit] = []
        self._group_of = {id(member): self.groups[id(g)] for member, g in (members or {}).items()}
        self.peak_gathered_bytes = 0
        self.copy_stream = copy_stream  # offload: host-to-device copies and their gathers run here
        self._hooks: list = []
        for module in needs:  # first: the user's own pre-hooks (weight_norm's, pruning's) read gathered values
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True, prepend=True))
            self._hooks.append(module.register_forward_hook(self._post_forward))
        for member in members or {}:
            self._hooks.append(member.register_forward_pre_hook(self._pre_forward_member, prepend=True))
        for slot in self.slots.values():
            if slot.unit.index in persistent:
                self._acquire(slot.unit)

    @property
    def units(self) -> list[FlatUnit]:
        return [slot.unit for slot in self.slots.values()]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def state_of(self, module: nn.Module) -> TrainingState:
        return self.groups[id(module)].state

    @property
    def gathered_bytes(self) -> int:
        """Bytes of unit storage alive now (gathered or being gathered), measured on the storages."""
        return sum(u.full_bytes for u in self.units if u.storage_alive)

    # ---- units ------------------------------------------------------------------------------
    def _issue(self, unit: FlatUnit) -> None:
        slot = self.slots[unit.index]
        if unit.state is UnitState.UNSHARDED or slot.pending is not None:
            return
        if self.schedule is not None:
            self.schedule.note(unit.index)
        with torch.inference_mode(False), torch.no_grad(), record_function(f"zero/all_gather[unit {unit.index}]"):
            unit.alloc_storage()
            if self.copy_stream is None or not unit.source_on_host:
                slot.pending = self.comm.all_gather(unit.full, unit.gather_source(), async_op=True)
            else:  # the host-to-device copy must not queue behind compute: a side stream, waited for at use
                self.copy_stream.wait_stream(torch.cuda.current_stream(unit.device))
                with torch.cuda.stream(self.copy_stream):
                    slot.pending = self.comm.all_gather(unit.full, unit.gather_source(), async_op=True)
                    slot.ready = torch.cuda.Event()
                    slot.ready.record(self.copy_stream)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _wait(self, unit: FlatUnit) -> None:
        slot = self.slots[unit.index]
        with record_function(f"zero/gather_wait[unit {unit.index}]"):
            if slot.ready is not None:
                torch.cuda.current_stream(unit.device).wait_event(slot.ready)
                slot.ready = None
            pending, slot.pending = slot.pending, None
            try:
                pending.wait()
            except RuntimeError as err:
                raise out_of_step("all-gather", unit.names) from err

    def _acquire(self, unit: FlatUnit) -> None:
        self.slots[unit.index].holders += 1
        if unit.state is UnitState.UNSHARDED:
            return
        shown = unit.moved_to()  # read before the gather: the placeholders tell where the user moved the module
        self._issue(unit)
        self._wait(unit)
        with torch.inference_mode(False):
            unit.point_params_at_full(shown)
        self.slots[unit.index].versions = _versions(unit)

    def _release(self, unit: FlatUnit) -> None:
        slot = self.slots[unit.index]
        slot.holders = max(slot.holders - 1, 0)
        if slot.holders == 0 and unit.index not in self.persistent:
            self._reshard(unit)

    def _reshard(self, unit: FlatUnit) -> None:
        if self.slots[unit.index].pending is not None:
            self._wait(unit)
        if unit.state is UnitState.UNSHARDED or unit.storage_alive:
            unit.release_full()

    def _prefetch(self, group: _Group) -> None:
        units = [u for u in group.units if u.state is UnitState.SHARDED and self.slots[u.index].pending is None]
        if not units:
            return
        for unit in units:
            self._issue(unit)
        self._prefetched.append(units)
        while len(self._prefetched) > self.prefetch:
            self._drop(self._prefetched.popleft())

    def _drop(self, units: list[FlatUnit]) -> None:
        """Free prefetched units nobody acquired (the shards may change before their next use)."""
        for unit in units:
            if unit.state is UnitState.SHARDED and self.slots[unit.index].holders == 0:
                self._reshard(unit)

    def gather_in(self, dtype: torch.dtype) -> None:
        """Every unit's gathers give ``dtype`` from now on (see FlatUnit.compute_in); the persistent units are
        gathered again at once (a collective: every rank calls it)."""
        self.drop_prefetches()
        for slot in self.slots.values():
            if slot.pending is not None:
                self._wait(slot.unit)
            slot.holders = 0
            if slot.unit.state is UnitState.UNSHARDED or slot.unit.storage_alive:
                slot.unit.release_full()
            slot.unit.compute_in(dtype)
        self._held_until_backward_end.clear()
        for slot in self.slots.values():
            if slot.unit.index in self.persistent:
                self._acquire(slot.unit)

    def drop_prefetches(self) -> None:
        while self._prefetched:
            self._drop(self._prefetched.popleft())

    def _prefetch_from(self, group: _Group, step: int) -> None:
        pos = self._position.get(id(group.module))
        if pos is None:
            return
        for k in range(1, self.prefetch + 1):
            j = pos + step * k
            if 0 <= j < len(self.order):
                self._prefetch(self.order[j])

    # ---- transitions -------------------------------------------------------------------------
    def pre_forward(self, group: _Group) -> None:
        """A forward of ``group`` begins: gather it and prefetch the next ones in forward order."""
        if not self._order_frozen and id(group.module) not in self._position:
            self._position[id(group.module)] = len(self.order)
            self.order.append(group)
        group.forwards += 1
        group.to(TrainingState.FORWARD)
        for unit in group.units:
            self._acquire(unit)
        self._prefetch_from(group, +1)

    def take_edits(self, units: Optional[list[FlatUnit]] = None) -> None:
        """Gathered units (default: all) whose parameters changed in place since their gather hand their edits to
        ``on_forward_edit``: only in forward time (outside backward, where an offloaded master may be stepping)."""
        if self.on_forward_edit is None:
            return
        for unit in units if units is not None else self.units:
            slot = self.slots[unit.index]
            if unit.state is UnitState.UNSHARDED and slot.versions is not None:
                now = _versions(unit)
                if now != slot.versions:
                    unit.pull_shown()
                    self.on_forward_edit(unit)
                    slot.versions = now

    def post_forward(self, group: _Group) -> None:
        """A forward of ``group`` ended: free it (its backward gathers it again). A unit the forward changed in
        place (``nn.Embedding(max_norm=...)`` renormalizes its rows) hands its edits to ``on_forward_edit``
        first: freed, they would be lost."""
        group.forwards -= 1
        self.take_edits(group.units)
        for unit in group.units:
            self._release(unit)
        group.settle()

    def pre_backward(self, call: _Call) -> None:
        """The backward of one forward call of a group begins: hold it, prefetch the previous ones."""
        self._order_frozen = True
        if call.held:
            return
        call.held = True
        group = call.group
        group.held += 1
        group.to(TrainingState.PRE_BACKWARD)
        for unit in group.units:
            self._acquire(unit)
        self._prefetch_from(group, -1)

    def post_backward(self, call: _Call) -> None:
        """That backward ended (its inputs' gradients exist): free the group, reduced or not."""
        if not call.held:
            return
        call.held = False
        group = call.group
        group.held -= 1
        for unit in group.units:
            self._release(unit)
        if not group.held and not group.forwards:
            group.to(TrainingState.POST_BACKWARD)

    def end_of_backward(self) -> None:
        for call in self._calls:
            self.post_backward(call)
        self._calls.clear()
        for group in self.groups.values():
            if group.state is TrainingState.POST_BACKWARD:
                group.to(TrainingState.IDLE)
        self.release_held()
        self.drop_prefetches()

    def release_held(self) -> None:
        for unit in self._held_until_backward_end:
            self._release(unit)
        self._held_until_backward_end.clear()

    # ---- hooks --------------------------------------------------------------------------------
    @torch.compiler.disable
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        group = self.groups[id(module)]
        if _in_backward():
            group.stack.append(self._recompute(group))
            return None
        if not self.scopes and not self._running and self.on_unscoped_forward is not None:
            self.on_unscoped_forward()  # user code calling the module itself: is every rank here?
        self._running += 1
        self.pre_forward(group)
        if not torch.is_grad_enabled():
            group.stack.append(None)
            return None
        call = _Call(group)
        self._calls.append(call)
        group.stack.append(call)
        return self._route_inputs(call, args, kwargs)

    def _route_inputs(self, call: _Call, args: tuple, kwargs: dict) -> Optional[tuple]:
        """Pass the tensor inputs that need a gradient through ``_PostBackward``."""
        flat, _ = tree_flatten((args, kwargs))
        needing = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
        if not needing:
            return None
        routed = dict(zip(map(id, needing), _PostBackward.apply(self, call, *needing)))
        return tree_map(lambda t: routed.get(id(t), t) if isinstance(t, torch.Tensor) else t, (args, kwargs))

    def _recompute(self, group: _Group) -> Optional[_Call]:
        """A forward inside backward (activation checkpointing): see [Note: recomputation]."""
        if any(c.held for c in self._calls if c.group is group):
            return None  # non-reentrant: the pre-backward of this group already holds it
        call = _Call(group)
        call.held = True
        group.held += 1
        group.to(TrainingState.PRE_BACKWARD)
        self._calls.append(call)
        for unit in group.units:
            self._acquire(unit)
        return call

    @torch.compiler.disable
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        group = self.groups[id(module)]
        call = group.stack.pop()
        if _in_backward():
            if call is not None and torch.is_grad_enabled():
                self._release_after_nested_backward(call, args)
            return
        self._running = max(self._running - 1, 0)
        self.post_forward(group)
        if call is None:
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            pre_backward = weakly(self.pre_backward)
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _g: pre_backward(call), mode="any")

    def _release_after_nested_backward(self, call: _Call, args: Any) -> None:
        inputs = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if inputs:  # reentrant recomputation: the nested backward reaches these inputs last
            post_backward = weakly(self.post_backward)

            def after_nested_backward(_grads: Any) -> None:
                # not at once: the parameters' AccumulateGrad nodes may still be queued beside the inputs' (the same
                # priority), so the group is released when the nested backward has finished
                torch.autograd.Variable._execution_engine.queue_callback(lambda: post_backward(call))

            torch.autograd.graph.register_multi_grad_hook(inputs, after_nested_backward, mode="all")

    @torch.compiler.disable
    def _pre_forward_member(self, module: nn.Module, args: Any) -> None:
        group = self._group_of[id(module)]
        if group.forwards or _in_backward():
            return  # the usual path: inside its group's forward (or a recomputation in backward)
        if not self.scopes and not self._running and self.on_unscoped_forward is not None \
                and any(unit not in self._held_until_backward_end for unit in group.units):
            self.on_unscoped_forward()  # user code (generate(), a head called alone): is every rank here?
        for unit in group.units:
            if unit not in self._held_until_backward_end:
                self._acquire(unit)  # held until backward (or the evaluation step) ends
                self._held_until_backward_end.append(unit)

    def check_schedule(self, wait: bool = False) -> None:
        """At the start of every step (``wait``: at the end of a loop): the ranks' gathers compared."""
        if self.schedule is not None:
            self.schedule.checkpoint(wait=wait)

    @contextmanager
    def scope(self) -> Iterator[None]:
        """A step whose every rank runs the forward (see [Note: forwards outside a step])."""
        self.check_schedule()
        self.scopes += 1
        try:
            yield
        finally:
            self.scopes -= 1

    @contextmanager
    def hold(self, module: nn.Module, until_backward_end: bool) -> Iterator[None]:
        """Keep ``module``'s group gathered for a scope (a Lightning step of the root module).

        With ``until_backward_end`` (training) it stays gathered until the backward that
        follows has finished: the loss may use the root's parameters outside its forward.
        """
        self.check_schedule()
        units = self.groups[id(module)].units
        for unit in units:
            self._acquire(unit)
        self.scopes += 1
        try:
            yield
        finally:
            self.scopes -= 1
            self.take_edits()  # the step's forwards are over: edits of what stays gathered until backward ends
            if until_backward_end:
                self._held_until_backward_end.extend(units)
            else:
                for unit in units:
                    self._release(unit)
                self.release_held()
                self.drop_prefetches()
