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

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import nn
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_map

from ..collectives import Comm, Handle
from .flat_unit import FlatUnit, UnitState

__all__ = ["Gatherer"]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Call:
    """One forward call of a group module; its backward holds the group from pre- to post-backward."""

    __slots__ = ("group", "held")

    def __init__(self, group: nn.Module) -> None:
        self.group = group
        self.held = False


class _PostBackward(torch.autograd.Function):
    """Identity on a group's inputs; its backward marks the end of the group's backward."""

    @staticmethod
    def forward(ctx: Any, gatherer: Gatherer, call: _Call, *inputs: torch.Tensor) -> tuple:
        ctx.gatherer, ctx.call = gatherer, call
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        ctx.gatherer.post_backward(ctx.call)
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
    """

    def __init__(self, needs: dict[nn.Module, list[FlatUnit]], comm: Comm, prefetch: int, persistent: set[int],
                 members: Optional[dict[nn.Module, nn.Module]] = None) -> None:
        self.needs = needs
        self.comm = comm
        self.prefetch = prefetch
        self.persistent = persistent
        self.units = sorted({id(u): u for us in needs.values() for u in us}.values(), key=lambda u: u.index)
        self.order: list[nn.Module] = []  # group modules in forward order (first training forward)
        self._order_frozen = False
        self._position: dict[int, int] = {}
        self._holders: dict[int, int] = {}  # unit index -> holders
        self._pending: dict[int, Handle] = {}  # unit index -> all-gather in flight, not yet waited for
        self._prefetched: deque[list[FlatUnit]] = deque()  # issued ahead of use, oldest first
        self._calls: list[_Call] = []  # training forward calls of this backward
        self._stack: dict[int, list[Optional[_Call]]] = {}  # id(group) -> calls whose forward is running
        self._active: dict[int, int] = {}  # id(group) -> forwards of it running now
        self._held_until_backward_end: list[FlatUnit] = []
        self._group_of = members or {}
        self.peak_gathered_bytes = 0
        self.copy_stream: Optional[Any] = None  # offload: host-to-device copies and their gathers run here
        self._ready: dict[int, Any] = {}  # unit index -> event the compute stream waits for before use
        self._hooks: list = []
        for module in needs:
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._hooks.append(module.register_forward_hook(self._post_forward))
        for member in self._group_of:
            self._hooks.append(member.register_forward_pre_hook(self._pre_forward_member))
        for unit in self.units:
            if unit.index in persistent:
                self._acquire(unit)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @property
    def gathered_bytes(self) -> int:
        """Bytes of unit storage alive now (gathered or being gathered), measured on the storages."""
        return sum(u.full_bytes for u in self.units if u.storage_alive)

    # ---- units ------------------------------------------------------------------------------
    def _issue(self, unit: FlatUnit) -> None:
        if unit.state is UnitState.UNSHARDED or unit.index in self._pending:
            return
        with torch.inference_mode(False), torch.no_grad(), record_function(f"zero/all_gather[unit {unit.index}]"):
            unit.alloc_storage()
            if self.copy_stream is None or not unit.source_on_host:
                self._pending[unit.index] = self.comm.all_gather(unit.full, unit.gather_source(), async_op=True)
            else:  # the host-to-device copy must not queue behind compute: a side stream, waited for at use
                self.copy_stream.wait_stream(torch.cuda.current_stream(unit.device))
                with torch.cuda.stream(self.copy_stream):
                    self._pending[unit.index] = self.comm.all_gather(unit.full, unit.gather_source(), async_op=True)
                    self._ready[unit.index] = torch.cuda.Event()
                    self._ready[unit.index].record(self.copy_stream)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _wait(self, unit: FlatUnit) -> None:
        with record_function(f"zero/gather_wait[unit {unit.index}]"):
            self._wait_for(unit)

    def _wait_for(self, unit: FlatUnit) -> None:
        ready = self._ready.pop(unit.index, None)
        if ready is not None:
            torch.cuda.current_stream(unit.device).wait_event(ready)
        try:
            self._pending.pop(unit.index).wait()
        except RuntimeError as err:
            raise RuntimeError(
                f"lightning_zero stage 3: the all-gather of parameters {unit.names[:3]}... did not complete on every "
                f"rank. The usual cause is ranks running different forward passes (uneven evaluation batches, or "
                f"data-dependent control flow that skips a group module on some ranks): under stage 3 every rank must "
                f"run the same group modules in the same order. Give each rank the same number of batches "
                f"(Lightning's DistributedSampler does), wrap the module that always runs (the MoE layer, not each "
                f"expert), or use stage 1/2.") from err

    def _acquire(self, unit: FlatUnit) -> None:
        self._holders[unit.index] = self._holders.get(unit.index, 0) + 1
        if unit.state is UnitState.UNSHARDED:
            return
        self._issue(unit)
        self._wait(unit)
        with torch.inference_mode(False):
            unit.point_params_at_full()

    def _release(self, unit: FlatUnit) -> None:
        left = self._holders.get(unit.index, 0) - 1
        self._holders[unit.index] = max(left, 0)
        if left <= 0 and unit.index not in self.persistent:
            self._reshard(unit)

    def _reshard(self, unit: FlatUnit) -> None:
        if unit.index in self._pending:
            self._wait(unit)
        if unit.state is UnitState.UNSHARDED or unit.storage_alive:
            unit.release_full()

    def _prefetch(self, group: nn.Module) -> None:
        units = [u for u in self.needs[group] if u.state is UnitState.SHARDED and u.index not in self._pending]
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
            if unit.state is UnitState.SHARDED and self._holders.get(unit.index, 0) == 0:
                self._reshard(unit)

    def drop_prefetches(self) -> None:
        while self._prefetched:
            self._drop(self._prefetched.popleft())

    def _prefetch_from(self, module: nn.Module, step: int) -> None:
        pos = self._position.get(id(module))
        if pos is None:
            return
        for k in range(1, self.prefetch + 1):
            j = pos + step * k
            if 0 <= j < len(self.order):
                self._prefetch(self.order[j])

    # ---- hooks --------------------------------------------------------------------------------
    @torch.compiler.disable
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        stack = self._stack.setdefault(id(module), [])
        if _in_backward():
            stack.append(self._recompute(module))
            return None
        if not self._order_frozen and id(module) not in self._position:
            self._position[id(module)] = len(self.order)
            self.order.append(module)
        self._active[id(module)] = self._active.get(id(module), 0) + 1
        for unit in self.needs[module]:
            self._acquire(unit)
        self._prefetch_from(module, +1)
        if not torch.is_grad_enabled():
            stack.append(None)
            return None
        call = _Call(module)
        self._calls.append(call)
        stack.append(call)
        return self._route_inputs(call, args, kwargs)

    def _route_inputs(self, call: _Call, args: tuple, kwargs: dict) -> Optional[tuple]:
        """Pass the tensor inputs that need a gradient through ``_PostBackward``."""
        flat, _ = tree_flatten((args, kwargs))
        needing = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
        if not needing:
            return None
        routed = dict(zip(map(id, needing), _PostBackward.apply(self, call, *needing)))
        return tree_map(lambda t: routed.get(id(t), t) if isinstance(t, torch.Tensor) else t, (args, kwargs))

    def _recompute(self, module: nn.Module) -> Optional[_Call]:
        """A forward inside backward (activation checkpointing): see [Note: recomputation]."""
        if any(c.held for c in self._calls if c.group is module):
            return None  # non-reentrant: the pre-backward of this group already holds it
        call = _Call(module)
        call.held = True
        self._calls.append(call)
        for unit in self.needs[module]:
            self._acquire(unit)
        return call

    @torch.compiler.disable
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        call = self._stack[id(module)].pop()
        if _in_backward():
            if call is not None and torch.is_grad_enabled():
                self._release_after_nested_backward(call, args)
            return
        self._active[id(module)] -= 1
        for unit in self.needs[module]:
            self._release(unit)
        if call is None:
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _g, c=call: self.pre_backward(c),
                                                          mode="any")

    def _release_after_nested_backward(self, call: _Call, args: Any) -> None:
        inputs = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if inputs:  # reentrant recomputation: the nested backward reaches these inputs last
            torch.autograd.graph.register_multi_grad_hook(inputs, lambda _g, c=call: self.post_backward(c),
                                                          mode="all")

    @torch.compiler.disable
    def _pre_forward_member(self, module: nn.Module, args: Any) -> None:
        group = self._group_of[module]
        if self._active.get(id(group), 0) or _in_backward():
            return  # the usual path: inside its group's forward (or a recomputation in backward)
        for unit in self.needs[group]:
            if unit not in self._held_until_backward_end:
                self._acquire(unit)  # held until backward (or the evaluation step) ends
                self._held_until_backward_end.append(unit)

    def pre_backward(self, call: _Call) -> None:
        self._order_frozen = True
        if call.held:
            return
        call.held = True
        for unit in self.needs[call.group]:
            self._acquire(unit)
        self._prefetch_from(call.group, -1)

    def post_backward(self, call: _Call) -> None:
        if call.held:
            call.held = False
            for unit in self.needs[call.group]:
                self._release(unit)

    def end_of_backward(self) -> None:
        for call in self._calls:
            self.post_backward(call)
        self._calls.clear()
        self.release_held()
        self.drop_prefetches()

    def release_held(self) -> None:
        for unit in self._held_until_backward_end:
            self._release(unit)
        self._held_until_backward_end.clear()

    @contextmanager
    def hold(self, group: nn.Module, until_backward_end: bool) -> Iterator[None]:
        """Keep ``group``'s units gathered for a scope (a Lightning step of the root module).

        With ``until_backward_end`` (training) they stay gathered until the backward that
        follows has finished: the loss may use the root's parameters outside its forward.
        """
        units = self.needs[group]
        for unit in units:
            self._acquire(unit)
        try:
            yield
        finally:
            if until_backward_end:
                self._held_until_backward_end.extend(units)
            else:
                for unit in units:
                    self._release(unit)
                self.release_held()
                self.drop_prefetches()
