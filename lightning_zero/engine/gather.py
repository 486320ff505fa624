"""Stage 3: parameters stay sharded between uses; module hooks gather them on demand.

[Note: groups and hooks]
A wrap policy picks *group modules* (transformer blocks, say; the root is always one).
Each parameter belongs to the units of the group module that first names it; a group
module *needs* the units of every parameter its own subtree uses (tied weights make one
module need another's unit). Hooks per group module:
- forward pre-hook: all-gather what it needs (waiting for a prefetch if one is in flight)
  and prefetch the needs of the next group module in recorded forward order;
- forward post-hook: free the units again, and hook the outputs so that backward gathers
  them before it reaches this module (and prefetches the previous module's);
- after a unit's gradients are reduce-scattered its parameters are freed; whatever is
  still gathered when backward ends is freed then.
Recomputation under activation checkpointing runs inside backward: nothing is freed there.
The root's units stay gathered for a whole Lightning step (``pin_root``), so code in
``training_step`` may use any parameter the root owns (``self.head.weight`` in a loss).

[Note: inference mode]
Buffers are allocated under ``inference_mode(False)``: a tensor created inside Lightning's
``inference_mode`` evaluation could not be reused by training afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..collectives import Comm, Handle
from .flat_unit import FlatUnit, UnitState

__all__ = ["Gatherer", "group_modules", "group_lookup", "build_needs", "owner_of", "members_of"]


def group_modules(root: nn.Module, class_names: tuple[str, ...], min_params: int) -> list[nn.Module]:
    """The root plus the modules that form a group of their own, in ``named_modules`` order.

    With ``class_names`` every module of those classes is a group. Otherwise a module with
    children becomes a group once its subtree holds ``min_params`` parameters that no
    deeper group took (leaf layers are never split off, so ``self.head.weight`` used in a
    loss still belongs to an enclosing, gathered group).
    """
    if class_names:
        chosen = [m for m in root.modules() if type(m).__name__ in class_names and m is not root]
        missing = set(class_names) - {type(m).__name__ for m in chosen}
        if missing:
            found = sorted({type(m).__name__ for m in root.modules()})
            raise ValueError(f"wrap_modules names {sorted(missing)}, which match no module of the model; its module "
                             f"classes are: {', '.join(found)}.")
        for m in chosen:
            if not _has_forward(m):
                raise ValueError(f"wrap_modules names {type(m).__name__}, which has no forward() (a container such "
                                 f"as ModuleList is iterated, never called), so its parameters would never be "
                                 f"gathered. Name the classes of the modules inside it instead.")
    else:
        chosen = []
        _size_policy(root, min_params, chosen, root)
    chosen_ids = {id(m) for m in chosen}
    return [root] + [m for m in root.modules() if id(m) in chosen_ids]


def _size_policy(module: nn.Module, min_params: int, chosen: list, root: nn.Module) -> int:
    free = sum(p.numel() for p in module.parameters(recurse=False))
    for child in module.children():
        free += _size_policy(child, min_params, chosen, root)
    if module is not root and any(True for _ in module.children()) and _has_forward(module) and free >= min_params:
        chosen.append(module)
        return 0
    return free


def _has_forward(module: nn.Module) -> bool:
    """Containers (ModuleList, ModuleDict) are never called: hooks on them would never fire."""
    return type(module).forward is not nn.Module.forward and not isinstance(module, (nn.ModuleList, nn.ModuleDict))


class Gatherer:
    """All-gathers and frees stage-3 units around the forward and backward of group modules.

    Args:
        needs: group module -> the units it must see gathered while it runs.
        root: the module whose units are pinned for a whole step.
        comm: collectives for the data-parallel group.
        prefetch: group modules ahead whose all-gather is issued early.
        persistent: units that stay gathered (too small to be worth freeing).
    """

    def __init__(self, needs: dict[nn.Module, list[FlatUnit]], root: nn.Module, comm: Comm, prefetch: int,
                 persistent: set[int], members: Optional[dict[nn.Module, nn.Module]] = None) -> None:
        self.needs = needs
        self.root = root
        self.comm = comm
        self.prefetch = prefetch
        self.persistent = persistent  # unit indices
        self.order: list[nn.Module] = []
        self._order_frozen = False
        self._position: dict[int, int] = {}
        self._pending: dict[int, tuple[FlatUnit, Handle]] = {}  # unit index -> all-gather in flight
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self._hooks: list = []
        for module in needs:
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(module.register_forward_hook(self._post_forward))
        # A member run without its group's forward (``self.vae.encode(x)`` calling layers of a
        # group directly) still finds its parameters: its group is gathered and stays so until
        # backward ends (training) or the step ends (evaluation).
        self._group_of = members or {}
        self._active: dict[int, int] = {}  # id(group module) -> forwards of it running now
        self._loose: list[FlatUnit] = []  # units gathered by a member outside its group's forward
        for member in self._group_of:
            self._hooks.append(member.register_forward_pre_hook(self._pre_forward_member))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ---- unshard / reshard ---------------------------------------------------------------
    def _issue(self, unit: FlatUnit) -> None:
        if unit.state is UnitState.UNSHARDED or unit.index in self._pending:
            return
        with torch.inference_mode(False), torch.no_grad():
            unit.full = torch.empty(unit.layout.padded_numel, dtype=unit.compute_dtype, device=unit.device)
            self._pending[unit.index] = (unit, self.comm.all_gather(unit.full, unit.gather_source(), async_op=True))

    def unshard(self, unit: FlatUnit) -> None:
        if unit.state is UnitState.UNSHARDED:
            return
        self._issue(unit)
        try:
            self._pending.pop(unit.index)[1].wait()
        except RuntimeError as err:
            raise RuntimeError(
                f"lightning_zero stage 3: the all-gather of parameters {unit.names[:3]}... did not complete on every "
                f"rank. The usual cause is ranks running different numbers of forward passes (uneven evaluation "
                f"batches from a custom sampler, or data-dependent control flow): under stage 3 every rank must run "
                f"the same forward passes. Give each rank the same number of batches (Lightning's "
                f"DistributedSampler does), or use stage 1/2 for that evaluation.") from err
        with torch.inference_mode(False):
            unit.point_params_at_full()
        self.gathered_bytes += unit.full.numel() * unit.full.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def reshard(self, unit: FlatUnit) -> None:
        if unit.state is UnitState.SHARDED or unit.pins > 0 or unit.index in self.persistent:
            return
        self.gathered_bytes -= unit.full.numel() * unit.full.element_size()
        unit.empty_params()
        unit.full = None

    def drop_prefetches(self) -> None:
        """Complete and discard all-gathers nobody consumed (the shards may change next)."""
        for unit, handle in self._pending.values():
            handle.wait()
            unit.full = None
        self._pending.clear()

    # ---- hooks ---------------------------------------------------------------------------
    def _prefetch_from(self, module: nn.Module, step: int) -> None:
        pos = self._position.get(id(module))
        if pos is None or not self.prefetch:
            return
        for k in range(1, self.prefetch + 1):
            j = pos + step * k
            if 0 <= j < len(self.order):
                for unit in self.needs[self.order[j]]:
                    self._issue(unit)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        in_backward = torch._C._current_graph_task_id() != -1
        if not self._order_frozen and not in_backward and id(module) not in self._position:
            self._position[id(module)] = len(self.order)
            self.order.append(module)
        self._active[id(module)] = self._active.get(id(module), 0) + 1
        for unit in self.needs[module]:
            unit.pins += 1
            self.unshard(unit)
        if not in_backward:
            self._prefetch_from(module, +1)

    def _pre_forward_member(self, module: nn.Module, args: Any) -> None:
        group = self._group_of[module]
        if self._active.get(id(group), 0) or torch._C._current_graph_task_id() != -1:
            return  # the usual path: inside its group's forward (or a recomputation in backward)
        for unit in self.needs[group]:
            if unit not in self._loose:
                unit.pins += 1  # held until backward (or the evaluation step) ends
                self._loose.append(unit)
            self.unshard(unit)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        in_backward = torch._C._current_graph_task_id() != -1
        self._active[id(module)] -= 1
        for unit in self.needs[module]:
            unit.pins -= 1
        if in_backward:
            return output  # recomputation for checkpointing: backward needs the weights right away
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _g, m=module: self._pre_backward(m),
                                                          mode="any")
        if module is not self.root or not torch.is_grad_enabled():
            for unit in self.needs[module]:
                self.reshard(unit)
        return output

    def _pre_backward(self, module: nn.Module) -> None:
        self._order_frozen = True
        for unit in self.needs[module]:
            self.unshard(unit)
        self._prefetch_from(module, -1)

    def on_unit_reduced(self, unit: FlatUnit) -> None:
        if all(p.requires_grad for p in unit.params):  # a frozen weight may still serve input gradients
            self.reshard(unit)

    def end_of_backward(self) -> None:
        for unit in self._loose:
            unit.pins -= 1
        self._loose.clear()
        self.drop_prefetches()
        for units in self.needs.values():
            for unit in units:
                self.reshard(unit)

    @contextmanager
    def pin_root(self) -> Iterator[None]:
        """Keep the root's units gathered for one Lightning step (training, validation, ...)."""
        units = self.needs[self.root]
        for unit in units:
            unit.pins += 1
            self.unshard(unit)
        try:
            yield
        finally:
            for unit in units:
                unit.pins -= 1
            if not torch.is_grad_enabled():  # training: backward frees them when it ends
                self.end_of_backward()


def group_lookup(module: nn.Module, groups: list[nn.Module]):
    """A function: qualified name (of a parameter or a module) -> the nearest group module above it."""
    prefix_of = {id(m): name for name, m in module.named_modules()}  # a shared module: its first name
    ordered = sorted(((prefix_of[id(g)], g) for g in groups), key=lambda t: -len(t[0]))

    def home(name: str) -> nn.Module:
        return next(g for prefix, g in ordered if prefix == "" or name == prefix or name.startswith(prefix + "."))

    return home


def members_of(module: nn.Module, groups: list[nn.Module]) -> dict[nn.Module, nn.Module]:
    """Each module that owns parameters directly, except group modules -> its nearest group module."""
    home, group_ids = group_lookup(module, groups), {id(g) for g in groups}
    return {m: home(name) for name, m in module.named_modules()
            if id(m) not in group_ids and any(True for _ in m.parameters(recurse=False))}


def build_needs(module: nn.Module, groups: list[nn.Module], unit_of: dict[int, FlatUnit]) -> dict[nn.Module,
                                                                                                    list[FlatUnit]]:
    """group module -> units of every parameter its subtree uses outside nested groups."""
    home = group_lookup(module, groups)
    needs: dict[nn.Module, list[FlatUnit]] = {g: [] for g in groups}
    for name, p in module.named_parameters(remove_duplicate=False):
        unit = unit_of.get(id(p))
        if unit is not None and unit not in needs[home(name)]:
            needs[home(name)].append(unit)
    return needs


def owner_of(module: nn.Module, groups: list[nn.Module]) -> dict[int, nn.Module]:
    """id(parameter) -> the group module that first names it (its unit's home)."""
    home = group_lookup(module, groups)
    return {id(p): home(name) for name, p in module.named_parameters()}
