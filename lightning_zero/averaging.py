"""Lightning's weight-averaging callbacks under stage 3: their hooks see whole parameters.

``StochasticWeightAveraging`` and ``WeightAveraging`` (EMA) read every parameter between steps to
update their averaged copy, and write the average back (at the end of training, and around each
validation for ``WeightAveraging``). Under stage 3 a sharded parameter is an empty placeholder
there, so each such hook runs inside :class:`lightning_zero.zero.GatheredParameters` over the whole
module: every rank sees the fp32 master values (what DDP's parameters hold), and what a writing
hook leaves becomes the masters. The price is the whole model gathered in fp32 on every rank for
the hook's duration (said once at setup).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["gather_for_averaging"]

# hook -> whether it writes parameters (its values go into the masters) or only reads them
_SWA_HOOKS = {"on_train_epoch_start": True, "on_train_end": True}
_WA_HOOKS = {"on_train_batch_end": False, "on_train_epoch_end": False, "on_train_end": True,
             "on_validation_epoch_start": True, "on_validation_epoch_end": True}


def _averaging_hooks(callback: Any) -> dict[str, bool]:
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    if isinstance(callback, StochasticWeightAveraging):
        return _SWA_HOOKS
    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # Lightning before 2.6
        return {}
    return _WA_HOOKS if isinstance(callback, WeightAveraging) else {}


def gather_for_averaging(trainer: Any, module: Any) -> tuple[list[str], Callable[[], None]]:
    """Wrap the parameter-reading hooks of ``trainer``'s averaging callbacks in a whole-module gather; returns the
    callbacks' names and a function that takes the wrappers off again."""
    from .zero import GatheredParameters

    wrapped: list[tuple[Any, str]] = []
    names = []
    for callback in trainer.callbacks:
        hooks = _averaging_hooks(callback)
        for hook, writes in hooks.items():
            original = getattr(callback, hook)

            @functools.wraps(original)
            def gathered(*args: Any, _original: Callable = original, _writes: bool = writes, **kwargs: Any) -> Any:
                with GatheredParameters(list(module.parameters()), modifier_rank=0 if _writes else None, fp32=True):
                    return _original(*args, **kwargs)

            setattr(callback, hook, gathered)  # an instance attribute: Lightning calls getattr(callback, hook)
            wrapped.append((callback, hook))
        if hooks:
            names.append(type(callback).__name__)

    def undo() -> None:
        for callback, hook in wrapped:
            if hook in vars(callback):
                delattr(callback, hook)

    return names, undo
