"""Activation checkpointing as a strategy option, applied by module class name.

Uses torch's composable, non-reentrant ``checkpoint`` (hooks, no wrapper module), so
parameter names and state-dict keys stay exactly as the user wrote them.
"""

from __future__ import annotations

import weakref

from torch import nn

__all__ = ["apply_activation_checkpointing"]

_done: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # a second fit must not checkpoint twice


def apply_activation_checkpointing(root: nn.Module, class_names: tuple[str, ...]) -> int:
    """Checkpoint every module whose class name is in ``class_names``; returns how many."""
    if not class_names:
        return 0
    from torch.distributed._composable import checkpoint

    chosen = [m for m in root.modules() if type(m).__name__ in class_names]
    if not chosen:
        found = sorted({type(m).__name__ for m in root.modules()})
        raise ValueError(f"activation_checkpointing={list(class_names)} matches no module of the model; "
                         f"its module classes are: {', '.join(found)}.")
    for module in chosen:
        if module not in _done:
            checkpoint(module)
            _done.add(module)
    return len(chosen)
