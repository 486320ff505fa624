"""Hooks that hold their owner weakly.

Autograd keeps hooks on the C++ side (a gradient accumulator's hooks, a graph's multi-grad hooks), out of the cycle
collector's sight, for as long as the parameter or the loss lives: a hook that held its engine part strongly would
keep a released engine (its units, masters and buffers) alive, e.g. beside the next one during zero_auto's move.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weakly(method: Callable[..., Any]) -> Callable[..., None]:
    """``method`` (a bound method) called with the same arguments while its object lives; a no-op after."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call
