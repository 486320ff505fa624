"""Full (consolidated) model and optimizer state, in the formats plain PyTorch uses.

[Note: why per original parameter]
Shards depend on the world size; original parameters do not. Every tensor is stored with
the shape of the parameter it belongs to, so a state written by N ranks loads on M ranks:
each rank slices its own piece back out. The optimizer state is exactly what
``torch.optim.Optimizer.state_dict()`` of the unsharded optimizer would hold (parameters
numbered in param-group order, their names added under ``"lightning_zero"``), so a plain
optimizer (DDP) loads it and it loads a plain optimizer's. Units are gathered one at a
time and moved to the CPU, so a rank's device never holds more than one unit's full state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn

from .engine import ZeroEngine
from .flat_unit import FlatUnit, UnitState
from .guard import allow_state_dict
from .optim import unwrap

__all__ = ["CheckpointMismatchError", "check_keys", "check_shapes", "keys_of", "dtype_named", "full_model_state", "load_model_state", "set_unit_values", "full_optimizer_state", "load_optimizer_state", "FORMAT"]

FORMAT = "lightning_zero.optimizer.v2"
_SCALAR_KEYS = ("step",)  # per-parameter counters: never sliced


def keys_of(module: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every state-dict key naming it (tied parameters have several)."""
    keys: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        keys.setdefault(id(p), []).append(name)
    return keys


@torch.no_grad()
def full_model_state(engine: ZeroEngine, keep: bool = True) -> dict[str, torch.Tensor]:
    """The module's ``state_dict()`` with every managed parameter as its fp32 master value (on CPU).

    Every rank takes part in the gathers; only ranks with ``keep`` hold the result in host memory
    (the others return an empty dict), so a large model is not copied into every rank's RAM.
    """
    module = engine.module
    keys = keys_of(module)
    managed = {id(p) for u in engine.units for p in u.params}
    with allow_state_dict():
        plain = module.state_dict(keep_vars=True)
    # copies (as the parameters' values are): a later step must not change a state dict already handed out
    state = {k: (v.detach().cpu().clone() if keep else None) if isinstance(v, torch.Tensor) and id(v) not in managed
             else v if not isinstance(v, torch.Tensor) else None for k, v in plain.items()}
    for unit, full in engine.gather_masters():
        if not keep:
            continue
        for param, view in zip(unit.params, unit.param_views(full)):
            value = view.cpu().clone()
            for key in keys[id(param)]:
                state[key] = value
    return {k: v for k, v in state.items() if v is not None} if keep else {}


@torch.no_grad()
def load_model_state(engine: ZeroEngine, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Write a full state dict (any world size wrote it) into masters, shards and buffers."""
    module = engine.module
    keys = keys_of(module)
    expected = {k for ks in keys.values() for k in ks} | {k for k, _ in module.named_buffers()}
    with allow_state_dict():
        expected |= set(module.state_dict(keep_vars=True).keys())
    if strict:
        check_keys(expected, state.keys())
    shapes = {k: shape for unit in engine.units for p, shape in zip(unit.params, unit.shapes) for k in keys[id(p)]}
    with allow_state_dict():
        shapes.update((k, v.shape) for k, v in module.state_dict(keep_vars=True).items() if k not in shapes)
    check_shapes(shapes, state)
    managed = set()
    for unit in engine.units:
        found = [next((k for k in keys[id(p)] if k in state), None) for p in unit.params]
        full = torch.zeros(unit.layout.padded_numel, dtype=torch.float32, device=engine.device)
        if None in found:  # parameters the checkpoint lacks keep their current values (one gather a unit)
            engine.comm.all_gather(full, unit.master.detach().to(engine.device))
        for param, view, key in zip(unit.params, unit.param_views(full), found):
            managed.add(id(param))
            if key is not None:
                view.copy_(state[key].reshape(view.shape))
        set_unit_values(unit, full)
    named = dict(module.named_parameters(remove_duplicate=False))
    for key, value in state.items():
        target = named.get(key)
        if target is not None and id(target) not in managed:
            target.data.copy_(value.to(target.dtype))
    for key, buf in module.named_buffers():
        if key in state:
            buf.copy_(state[key])


class CheckpointMismatchError(KeyError):
    """A checkpoint of another model (keys missing or unexpected); the message names them."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


def check_keys(expected: Any, have: Any, path: Any = None) -> None:
    """One line naming the first missing and unexpected keys (torch's own message spans many lines)."""
    missing, unexpected = sorted(set(expected) - set(have)), sorted(set(have) - set(expected))
    if missing or unexpected:
        raise CheckpointMismatchError(f"Checkpoint {path or ''} does not match the model: missing keys {missing[:5]}"
                       f"{' ...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
                       f"{' ...' if len(unexpected) > 5 else ''}. Resume from a checkpoint of this model, or load "
                       f"the weights with strict=False.")


def check_shapes(expected: Mapping[str, Any], state: Mapping[str, Any], path: Any = None) -> None:
    """One line naming the first tensors whose sizes differ (a model built with other sizes: torch would print a
    line per tensor, from deep inside the load)."""
    wrong = [(k, tuple(state[k].shape), tuple(shape)) for k, shape in expected.items()
             if isinstance(state.get(k), torch.Tensor) and tuple(state[k].shape) != tuple(shape)]
    if wrong:
        listed = "; ".join(f"'{k}' is {saved} there and {mine} here" for k, saved, mine in wrong[:3])
        raise CheckpointMismatchError(f"Checkpoint {path or ''} does not match the model's sizes: {listed}"
                                      f"{f' (and {len(wrong) - 3} more)' if len(wrong) > 3 else ''}. Resume from a "
                                      f"checkpoint of a model built with the same sizes.")


def set_unit_values(unit: FlatUnit, full: torch.Tensor) -> None:
    unit.master.copy_(full[unit.shard_slice])
    unit.refresh_param_shard()
    if unit.state is UnitState.UNSHARDED and unit.full is not None:
        unit.full.copy_(full)


def is_elementwise(key: str, value: Any, numel: int) -> bool:
    """A piece's per-element state (exp_avg, ...): 1D like the piece; counters (step) are 0-dim."""
    return isinstance(value, torch.Tensor) and key not in _SCALAR_KEYS and value.dim() == 1 and value.numel() == numel


def _is_full_elementwise(key: str, value: Any, shape: torch.Size, listed: Any) -> bool:
    """A saved per-element state: listed as such (our format), or shaped like its parameter (torch's)."""
    if listed is not None:
        return key in listed
    return isinstance(value, torch.Tensor) and key not in _SCALAR_KEYS and tuple(value.shape) == tuple(shape)


@torch.no_grad()
def full_optimizer_state(engine: ZeroEngine, optimizer: Any, keep: bool = True) -> dict[str, Any]:
    """``optimizer.state_dict()`` as the unsharded optimizer would return it (on CPU).

    As for :func:`full_model_state`, ranks without ``keep`` join the gathers and return ``{}``.
    """
    optimizer = unwrap(optimizer)
    slots = engine.slots_of(optimizer)
    local: dict[int, dict[str, Any]] = {}  # index -> scalar state, and which keys are elementwise (dtype)
    for index, (unit, slot) in enumerate(slots):
        piece = unit.pieces[slot]
        entry = optimizer.state.get(piece) if piece is not None else None
        if entry:
            local[index] = {k: (str(v.dtype) if is_elementwise(k, v, piece.numel()) else cpu_copy(v))
                            for k, v in entry.items()}
    merged: dict[int, dict[str, Any]] = {}
    for part in engine.comm.all_gather_object(local):
        for index, entry in part.items():
            merged.setdefault(index, {}).update(entry)
    state: dict[int, dict[str, Any]] = {i: {k: v for k, v in e.items() if not isinstance(v, str)}
                                        for i, e in merged.items()}
    by_unit: dict[int, list[int]] = {}
    for index, (unit, _) in enumerate(slots):
        by_unit.setdefault(unit.index, []).append(index)
    for unit_index, indices in sorted(by_unit.items()):
        _gather_elementwise(engine, optimizer, engine.units[unit_index], indices, slots, merged, state, keep)
    if not keep:
        return {}
    groups, names = torch_param_groups(engine, optimizer)
    elementwise = sorted({k for e in merged.values() for k, v in e.items() if isinstance(v, str)})
    return {"state": state, "param_groups": groups,
            "lightning_zero": {"format": FORMAT, "param_names": names, "elementwise": elementwise,
                               "optimizer": optimizer_class(optimizer)}}


def torch_param_groups(engine: ZeroEngine, optimizer: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """``optimizer.state_dict()["param_groups"]`` (parameters numbered in group order) and their names."""
    names, groups, start = [], [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + count))})
        names += [engine.names[id(p)] for p in group["params"]]
        start += count
    return groups, names


def _gather_elementwise(engine: ZeroEngine, optimizer: torch.optim.Optimizer, unit: FlatUnit, indices: list[int],
                        slots: list, merged: dict, state: dict, keep: bool) -> None:
    """All-gather one unit's elementwise state (exp_avg, ...), one key at a time."""
    keys = sorted({(k, v) for i in indices for k, v in merged.get(i, {}).items() if isinstance(v, str)})
    for key, dtype_name in keys:
        shard = torch.zeros(unit.layout.shard_numel, dtype=dtype_named(dtype_name),
                            device=engine.device)
        for index in indices:
            slot = slots[index][1]
            piece, where = unit.pieces[slot], unit.spans[slot]
            value = optimizer.state.get(piece, {}).get(key) if piece is not None else None
            if value is not None:
                shard[where.shard_start:where.shard_start + where.length].copy_(value.reshape(-1))
        full = torch.empty(unit.layout.padded_numel, dtype=shard.dtype, device=engine.device)
        engine.comm.all_gather(full, shard)
        if keep:
            views = unit.param_views(full)
            for index in indices:
                if key in merged.get(index, {}):
                    state[index][key] = views[slots[index][1]].cpu().clone()


def dtype_named(name: str) -> torch.dtype:
    """The dtype a saved name such as "torch.float32" stands for."""
    return getattr(torch, name.split(".")[-1])


def cpu_copy(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


@torch.no_grad()
def optimizer_class(optimizer: Any) -> str:
    """What a checkpoint records of the optimizer that wrote it (see :func:`check_same_optimizer`)."""
    return type(unwrap(optimizer)).__name__


def check_same_optimizer(saved_class: Optional[str], optimizer: Any, where: Any) -> None:
    """A checkpoint's optimizer state loads only into the optimizer class that wrote it: AdamW's exp_avg in an
    SGD's state (and AdamW's betas in its groups) would resume without a word and train as neither."""
    mine = optimizer_class(optimizer)
    if saved_class and saved_class != mine:
        raise ValueError(f"Checkpoint{f' {where}' if where else ''} holds {saved_class} state, but this run's optimizer is {mine}: its "
                         f"state and hyperparameters would be loaded into {mine}'s. Build the same optimizer in "
                         f"configure_optimizers to resume, or start the new optimizer from the weights alone "
                         f"(LightningModule.load_from_checkpoint, then fit without ckpt_path; the DeepSpeed-style "
                         f"engine: load_checkpoint(..., load_optimizer_states=False)).")


def load_optimizer_state(engine: ZeroEngine, optimizer: Any, saved: dict[str, Any]) -> None:
    """Slice a full optimizer state (ours at any world size, or a plain optimizer's) into this rank's pieces."""
    optimizer = unwrap(optimizer)
    if "state" not in saved or "param_groups" not in saved:
        raise ValueError("This optimizer state is neither torch's format nor lightning_zero's; resume it with the "
                         "strategy that wrote it, or load only the weights.")
    check_same_optimizer(saved.get("lightning_zero", {}).get("optimizer"), optimizer, None)
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"Checkpoint has {len(saved['param_groups'])} optimizer param groups, the optimizer "
                         f"has {len(optimizer.param_groups)}: configure_optimizers must build the same groups.")
    slots = engine.slots_of(optimizer)
    names = saved.get("lightning_zero", {}).get("param_names")
    listed = saved.get("lightning_zero", {}).get("elementwise")
    index_of = _saved_index(engine, slots, names, saved)
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for param_index, (unit, slot) in enumerate(slots):
        piece, where = unit.pieces[slot], unit.spans[slot]
        entry = saved["state"].get(index_of[param_index])
        if piece is None:
            continue
        if not entry:  # as torch's load_state_dict: a parameter without saved state starts fresh (a checkpoint
            optimizer.state.pop(piece, None)  # written before its first step, restored after steps: LearningRateFinder)
            continue
        group = group_of[id(unit.params[slot])]
        out = {}
        for key, value in entry.items():
            if _is_full_elementwise(key, value, unit.shapes[slot], listed):
                value = value.reshape(-1)[where.param_start:where.param_start + where.length]
                out[key] = value.to(device=piece.device, dtype=piece.dtype if value.is_floating_point() else None)
            elif key == "step" and isinstance(value, torch.Tensor) and (group.get("fused") or group.get("capturable")):
                out[key] = value.to(device=piece.device, dtype=torch.float32)
            else:
                out[key] = cpu_copy(value)
        optimizer.state[piece] = out


def _saved_index(engine: ZeroEngine, slots: list, names: Any, saved: dict[str, Any]) -> list[Any]:
    """Which saved index holds each of the optimizer's parameters: by name when the checkpoint
    has names, else by position (a plain optimizer's checkpoint, same configure_optimizers)."""
    saved_ids = [i for g in saved["param_groups"] for i in g["params"]]
    if len(saved_ids) != len(slots):
        raise ValueError(f"Checkpoint's optimizer has {len(saved_ids)} parameters, this one {len(slots)}: "
                         f"configure_optimizers must build the same parameter groups.")
    if names is None:
        return saved_ids
    position = {n: saved_ids[i] for i, n in enumerate(names)}
    mine = [u.names[s] for u, s in slots]
    lacking = [n for n in mine if n not in position]
    if lacking:
        raise ValueError(f"Checkpoint's optimizer state has no entry for {lacking[:5]}: it was written for "
                         f"another model or other parameter groups.")
    return [position[n] for n in mine]
