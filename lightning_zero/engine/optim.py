"""Adopting the user's optimizer: keep the object and its parameters, step this rank's pieces.

[Note: why the module's parameters stay in the optimizer]
LR schedulers, Lightning's LightningOptimizer, ``toggle_optimizer`` and callbacks such as
``BackboneFinetuning`` hold the optimizer and read or change its ``param_groups`` in terms of
the module's parameters (identity maps, ``add_param_group`` with newly unfrozen layers).
So the groups keep the module's parameters. Only for the duration of a step each group's
list is swapped for the fp32 *pieces* of those parameters this rank owns (see
:mod:`lightning_zero.engine.flat_unit`); the optimizer's ``state`` is therefore keyed by
pieces. A piece whose parameter got no gradient on any rank keeps ``grad = None`` and
torch's optimizers leave it, and its state, alone. This is exact only for optimizers whose
update is elementwise: each element's new value depends on its own history alone.

The adopted optimizer's ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict``
are routed through the engine, so calling them directly cannot silently do nothing.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["ELEMENTWISE_OPTIMIZERS", "UnsupportedOptimizerError", "check_optimizer", "adopt", "release",
           "pieces_in_groups", "unwrap"]

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in
    ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
    if hasattr(torch.optim, name)
)
_ROUTED = ("step", "zero_grad", "state_dict", "load_state_dict")


class UnsupportedOptimizerError(TypeError):
    """The optimizer's math is not known to be exact on flat shards."""


def unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """The user's optimizer behind Lightning's LightningOptimizer."""
    return getattr(optimizer, "_optimizer", optimizer)


def check_optimizer(optimizer: torch.optim.Optimizer, allow_untested: bool) -> None:
    """Refuse optimizers whose update is not known to be elementwise.

    A subclass of a known optimizer passes only if it does not override ``step``.
    """
    # torch wraps ``step`` of each optimizer class for profiling: compare the unwrapped functions.
    step = inspect.unwrap(type(optimizer).step)
    if any(isinstance(optimizer, cls) and step is inspect.unwrap(cls.step) for cls in ELEMENTWISE_OPTIMIZERS):
        return
    if allow_untested:
        return
    names = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
    raise UnsupportedOptimizerError(
        f"lightning_zero steps the optimizer on flat parameter shards, which is exact only for "
        f"elementwise optimizers ({names}). {type(optimizer).__name__} is not one of them, so its "
        f"result could differ from unsharded training. Use one of those, or set "
        f"ZeroConfig(allow_untested_optimizer=True) if you know its update is elementwise."
    )


def adopt(optimizer: torch.optim.Optimizer, step: Callable, zero_grad: Callable,
          extra: Optional[list[Any]] = None) -> None:
    """Route ``optimizer``'s (and its LightningOptimizer wrappers') methods through the engine.

    Args:
        optimizer: the user's optimizer, still holding the module's parameters.
        step: ``step(optimizer, closure)``: the engine's step.
        zero_grad: ``zero_grad(optimizer, set_to_none)``: clears the pieces' gradients.
        extra: wrappers (LightningOptimizer) that copied the optimizer's attributes.
    """
    if any(len(s) for s in optimizer.state.values()):
        raise RuntimeError(
            "The optimizer already holds state before lightning_zero sharded it. Create it in "
            "configure_optimizers without stepping it, or restore its state from a checkpoint after setup.")
    original_zero_grad = optimizer.zero_grad
    inner_step = optimizer.step

    def zero_step(self: Any, closure: Optional[Callable] = None, **kwargs: Any) -> Any:
        return step(optimizer, closure, **kwargs)

    def zero_zero_grad(self: Any, set_to_none: bool = True) -> None:
        original_zero_grad(set_to_none=set_to_none)
        zero_grad(optimizer, set_to_none)

    def no_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "This optimizer is sharded by lightning_zero: its state lives in pieces spread over the ranks. "
            "Save and restore it with trainer.save_checkpoint / trainer.fit(ckpt_path=...), or "
            "strategy.optimizer_state(optimizer) for the full, consolidated state.")

    optimizer._zero_inner_step = inner_step  # what a step runs once the pieces are in place
    if getattr(inner_step, "_wrapped_by_lr_sched", False):  # the scheduler's own wrapper still runs inside
        zero_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = types.MethodType(zero_step, optimizer)  # a LightningOptimizer steps through the strategy
    for target in [optimizer, *(extra or [])]:
        target.zero_grad = types.MethodType(zero_zero_grad, target)
        target.state_dict = types.MethodType(no_state_dict, target)
        target.load_state_dict = types.MethodType(no_state_dict, target)


def release(optimizer: torch.optim.Optimizer, extra: Optional[list[Any]] = None) -> None:
    """Undo :func:`adopt` (teardown): the optimizer's own methods again."""
    inner = optimizer.__dict__.pop("_zero_inner_step", None)
    for target in [optimizer, *(extra or [])]:
        for name in _ROUTED:
            if name != "step" or target is optimizer:
                target.__dict__.pop(name, None)
    if inner is not None and getattr(inner, "_wrapped_by_lr_sched", False):
        optimizer.step = inner  # keep an LR scheduler's step counter


@contextmanager
def pieces_in_groups(optimizer: torch.optim.Optimizer,
                     piece_of: Callable[[nn.Parameter], Optional[nn.Parameter]]) -> Iterator[None]:
    """For a step: each group lists this rank's pieces of its parameters instead of the parameters."""
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["params"] = [q for q in (piece_of(p) for p in group["params"]) if q is not None]
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params
