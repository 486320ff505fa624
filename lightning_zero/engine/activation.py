"""Activation checkpointing as a strategy option, applied by module class name.

Each chosen module's ``forward`` runs under torch's non-reentrant ``torch.utils.checkpoint.checkpoint``
(the function form, set on the instance: no wrapper module), so parameter names and state-dict keys
stay exactly as the user wrote them, and a ``torch.compile`` of an enclosing module traces it as
torch's own checkpoint (torch's hook-based composable form fails there: the recomputation's
metadata differs from the compiled forward's).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config import ZeroConfigError

__all__ = ["apply_activation_checkpointing"]

_done: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # a second fit must not checkpoint twice


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: no graph, nothing to recompute
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(root: nn.Module, class_names: tuple[str, ...]) -> int:
    """Checkpoint every module whose class name is in ``class_names``; returns how many."""
    if not class_names:
        return 0
    chosen = [m for m in root.modules() if type(m).__name__ in class_names]
    if not chosen:
        found = sorted({type(m).__name__ for m in root.modules()})
        raise ZeroConfigError(f"activation_checkpointing={list(class_names)} matches no module of the model; "
                         f"its module classes are: {', '.join(found)}.")
    for module in chosen:
        if module not in _done:
            module.forward = functools.partial(_checkpointed, module.forward)
            _done.add(module)
    return len(chosen)
