"""A module whose parameters live in the engine: what its ``state_dict`` and ``load_state_dict`` do.

``state_dict``: a module whose parameters are sharded must not hand out empty tensors.

Under stage 3 a sharded parameter is an empty placeholder (see [Note: sharded parameters]);
``module.state_dict()`` would silently return those. Gathering instead would need every rank
to call it at once (a user saving on rank 0 only would hang), so it is an error that names
the ways to get the real values.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import nn

from .flat_unit import FlatUnit, UnitState

__all__ = ["allow_state_dict", "install_state_dict_guard", "install_load_into_masters", "ShardedStateDictError",
           "placeholder_note", "note_placeholder_use"]

_allowed = [0]


def note_placeholder_use(err: RuntimeError, units: Any, position: dict[int, int], names: dict[int, str],
                         only_sharded: bool) -> None:
    """Add :func:`placeholder_note` to ``err`` for the parameters of ``units`` (the sharded ones, or all)."""
    candidates = {position[id(p)]: names[id(p)] for u in units if u.state is UnitState.SHARDED or not only_sharded
                  for p in u.params if id(p) in position}
    note = placeholder_note(str(err), candidates)
    if note is not None and note not in getattr(err, "__notes__", ()):
        err.add_note(note)


class ShardedStateDictError(RuntimeError):
    pass


# A placeholder's second size is its parameter's position + 1 (see [Note: sharded parameters]), so a shape
# error that shows an empty operand names the parameter: "1x0" (F.linear's transposed weight), "0x7", "[0, 7]".
_EMPTY_OPERAND = re.compile(r"\b(\d+)x0\b|\b0x(\d+)\b|\[0, (\d+)\]|\(0, (\d+)\)")


def placeholder_note(message: str, sharded: dict[int, str]) -> Optional[str]:
    """The note for an error raised while the parameters at ``sharded`` (position -> name) were placeholders,
    where its message shows one of them as an operand; None when it shows none."""
    names = []
    for match in _EMPTY_OPERAND.finditer(message):
        name = sharded.get(int(next(g for g in match.groups() if g is not None)) - 1)
        if name is not None and name not in names:
            names.append(name)
    if not names:
        return None
    listed = ", ".join(f"'{n}'" for n in names)
    return (f"lightning_zero: {listed} {'is' if len(names) == 1 else 'are'} sharded here (an empty placeholder): "
            f"stage 3 gathers a module's parameters only while that module's own forward runs, and this code used "
            f"{'it' if len(names) == 1 else 'them'} outside it (F.linear(x, self.layer.weight) in a parent's "
            f"forward, a penalty over self.parameters() in training_step). Call the module itself, or take its class "
            f"out of wrap_modules so that the parameter joins the group of the module whose forward uses it (a "
            f"penalty on every weight: the optimizer's weight_decay).")


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


def install_load_into_masters(module: nn.Module, units: list[FlatUnit]) -> list[Any]:
    """``module.load_state_dict`` (and ``set_model_state_dict``, which calls it) writes into the fp32 masters.

    Without this, loading after setup would change only the compute copies (stages 1/2: the next step
    overwrites them from the masters) or fail on the empty placeholders (stage 3), and training would go on
    from the old weights. Full tensors and DTensors (``lightning_module_state_dict()``'s, gathered with
    ``full_tensor()``: then every rank must load) are taken. Returns the hook handles."""
    slot_of = {id(p): (u, i) for u in units for i, p in enumerate(u.params)}
    handles = []
    for sub in module.modules():
        owned = {n: slot_of[id(p)] for n, p in sub._parameters.items() if p is not None and id(p) in slot_of}
        if owned:
            hook = _LoadIntoMasters(owned)
            handles.append(sub._register_load_state_dict_pre_hook(hook, with_module=True))
            handles.append(sub.register_load_state_dict_post_hook(hook.after))
    return handles


class _LoadIntoMasters:
    def __init__(self, owned: dict[str, tuple[FlatUnit, int]]) -> None:
        self.owned = owned
        self.placeholders: list[tuple[FlatUnit, int]] = []  # stage 3: torch copies the placeholder onto itself

    def after(self, module: nn.Module, incompatible: Any) -> None:
        # that self-copy bumped the placeholder's version counter: it is no edit (the value is in the master)
        for unit, slot in self.placeholders:
            if unit.released_versions:
                unit.released_versions[slot] = unit.params[slot]._version
        self.placeholders = []

    @torch.no_grad()
    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                 missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        from torch.distributed.tensor import DTensor

        for name, (unit, slot) in self.owned.items():
            key = prefix + name
            value = state_dict.get(key)
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if not isinstance(value, torch.Tensor):
                continue
            param = module._parameters[name]
            shape = torch.Size(unit.shapes[slot])
            if value.shape != shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                                  f"checkpoint, the shape in current model is {tuple(shape)}.")
                state_dict[key] = param.detach()  # reported here; torch would compare with the placeholder
                continue
            piece = unit.spans[slot]
            if piece is not None:
                unit.master.detach()[piece.shard_start:piece.shard_start + piece.length].copy_(
                    value.detach().reshape(-1)[piece.param_start:piece.param_start + piece.length])
            if param.numel() == value.numel():
                state_dict[key] = value
            else:  # stage 3: a placeholder
                state_dict[key] = param.detach()
                self.placeholders.append((unit, slot))
            unit.refresh_param_shard()
