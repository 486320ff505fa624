"""A module whose parameters are sharded must not hand out empty tensors as its state dict.

Under stage 3 a sharded parameter is an empty placeholder (see [Note: sharded parameters]);
``module.state_dict()`` would silently return those. Gathering instead would need every rank
to call it at once (a user saving on rank 0 only would hang), so it is an error that names
the ways to get the real values.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from .flat_unit import FlatUnit, UnitState

__all__ = ["allow_state_dict", "install_state_dict_guard", "ShardedStateDictError"]

_allowed = [0]


class ShardedStateDictError(RuntimeError):
    pass


@contextmanager
def allow_state_dict() -> Iterator[None]:
    """Our own reads of ``module.state_dict()`` (they replace the placeholders by the real values)."""
    _allowed[0] += 1
    try:
        yield
    finally:
        _allowed[0] -= 1


def install_state_dict_guard(module: nn.Module, units: list[FlatUnit]) -> list[Any]:
    """Register the check on every submodule that owns a parameter of ``units``; returns the handles."""
    unit_of = {id(p): u for u in units for p in u.params}
    handles = []
    for name, sub in module.named_modules():
        owned = [unit_of[id(p)] for p in sub._parameters.values() if p is not None and id(p) in unit_of]
        if owned:
            handles.append(sub.register_state_dict_pre_hook(_Guard(owned, name)))
    return handles


class _Guard:
    def __init__(self, units: list[FlatUnit], name: str) -> None:
        self.units, self.name = units, name

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if _allowed[0] or not any(u.state is UnitState.SHARDED for u in self.units):
            return
        raise ShardedStateDictError(
            f"state_dict() of '{prefix.rstrip('.') or type(module).__name__}': its parameters are sharded across "
            f"ranks by ZeroStrategy(stage=3) (each rank holds only its part), so this would return empty tensors. "
            f"Get the real values with trainer.strategy.full_state_dict() (call it on every rank; rank 0 gets the "
            f"full fp32 state dict on CPU), from a checkpoint with `python -m lightning_zero.consolidate CKPT_DIR "
            f"OUT.ckpt --weights-only OUT.pt`, or train with stage 1/2, whose module holds full parameters.")
