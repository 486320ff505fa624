"""What a backward will produce, and in which order units finish: inputs of the reduction schedule.

[Note: expected gradients]
A unit is reduced as soon as every gradient it will get in this backward has arrived. Which
parameters get one is read off the autograd graph before backward runs: the leaves whose
AccumulateGrad node is reachable from the loss (frozen, unused and unreached parameters are
not). Reentrant activation checkpointing hides the layers it recomputes behind one node
(``CheckpointFunctionBackward``); when the graph holds one, every trainable parameter is
expected, so nothing is reduced before its gradient exists.

[Note: launch order]
Collectives must be issued in the same order on every rank. Backward finishes units in the
reverse of the order their modules *started* in forward (registration order says nothing:
a stem registered after the blocks runs before them). Rank 0 records module start times in
its first training forward; at the first backward every rank adopts rank 0's order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

__all__ = ["reached_leaves", "ForwardOrder"]

_OPAQUE = ("CheckpointFunctionBackward",)


def reached_leaves(roots: Iterable[torch.Tensor]) -> tuple[set[int], bool]:
    """ids of the leaf tensors backward from ``roots`` will accumulate into, and whether an
    opaque node (reentrant checkpointing) may accumulate into more."""
    stack = [r.grad_fn for r in roots if isinstance(r, torch.Tensor) and r.grad_fn is not None]
    seen: set = set()
    leaves: set[int] = set()
    opaque = False
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        elif type(node).__name__ in _OPAQUE:
            opaque = True
        stack.extend(fn for fn, _ in node.next_functions)
    return leaves, opaque


class ForwardOrder:
    """Start order of the modules that own parameters, recorded in the first training forward."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.start: dict[int, int] = {}
        self._hooks = [m.register_forward_pre_hook(self._record) for m in root.modules()
                       if any(True for _ in m.parameters(recurse=False))]

    @torch.compiler.disable
    def _record(self, module: nn.Module, args: object) -> None:
        if torch.is_grad_enabled() and id(module) not in self.start:
            self.start[id(module)] = len(self.start)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def param_times(self) -> dict[int, int]:
        """id(parameter) -> start time of the earliest module using it (-1: none ran).

        A module that did not run inherits the time of its nearest ancestor that did, so an
        expert idle in the recorded forward sits beside its siblings.
        """
        times: dict[int, int] = {}

        def visit(module: nn.Module, inherited: int) -> None:
            t = self.start.get(id(module), inherited)
            for p in module.parameters(recurse=False):
                old = times.get(id(p), -1)
                times[id(p)] = t if old < 0 else (old if t < 0 else min(old, t))
            for child in module.children():
                visit(child, t)

        visit(self.root, -1)
        return times

    def unit_order(self, units_params: Sequence[Sequence[nn.Parameter]]) -> list[int]:
        """Indices of units in the order backward finishes them: the unit whose earliest
        parameter started last in forward comes first (ties keep the given order)."""
        times = self.param_times()
        finish = [min((t for t in (times.get(id(p), -1) for p in params) if t >= 0), default=-1)
                  for params in units_params]
        return sorted(range(len(units_params)), key=lambda i: -finish[i])
