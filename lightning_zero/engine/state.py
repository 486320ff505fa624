"""Full (consolidated) model and optimizer state, keyed by the original parameter names.

[Note: why per original parameter]
Shards depend on the world size; original parameters do not. Every tensor is stored with
the shape of the parameter it belongs to, so a state written by N ranks loads on M ranks:
each rank slices its own pieces back out. Units are gathered one at a time and moved to
the CPU, so a rank's device never holds more than one unit's full state at once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .engine import ZeroEngine, _unwrap
from .flat_unit import FlatUnit

__all__ = ["full_model_state", "load_model_state", "full_optimizer_state", "load_optimizer_state", "FORMAT"]

FORMAT = "lightning_zero.optimizer.v1"


def _keys_of(module: nn.Module) -> dict[int, list[str]]:
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
    keys = _keys_of(module)
    managed = {id(p) for u in engine.units for p in u.params}
    state = {k: v.detach().cpu() if not isinstance(v, torch.Tensor) or id(v) not in managed else None
             for k, v in module.state_dict(keep_vars=True).items()}
    for unit, full in engine.gather_masters():
        if not keep:
            continue
        for param, view in zip(unit.params, unit.views(full)):
            value = view.cpu().clone()
            for key in keys[id(param)]:
                state[key] = value
    return {k: v for k, v in state.items() if v is not None} if keep else {}


@torch.no_grad()
def load_model_state(engine: ZeroEngine, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Write a full state dict (any world size wrote it) into masters, shards and buffers."""
    module = engine.module
    keys = _keys_of(module)
    expected = set(module.state_dict().keys())
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if strict and (missing or unexpected):
        raise KeyError(f"Checkpoint does not match the model: missing keys {missing[:10]}, "
                       f"unexpected keys {unexpected[:10]}. Load with strict=False to ignore them.")
    managed = set()
    for unit in engine.units:
        found = [next((k for k in keys[id(p)] if k in state), None) for p in unit.params]
        full = torch.zeros(unit.layout.padded_numel, dtype=torch.float32, device=engine.device)
        if None in found:  # parameters the checkpoint lacks keep their current values (one gather a unit)
            engine.comm.all_gather(full, unit.master.detach())
        for param, view, key in zip(unit.params, unit.views(full), found):
            managed.add(id(param))
            if key is not None:
                view.copy_(state[key].reshape(view.shape))
        _set_unit_values(unit, full)
    named = dict(module.named_parameters(remove_duplicate=False))
    for key, value in state.items():
        target = named.get(key)
        if target is not None and id(target) not in managed:
            target.data.copy_(value.to(target.dtype))
    for key, buf in module.named_buffers():
        if key in state:
            buf.copy_(state[key])


def _set_unit_values(unit: FlatUnit, full: torch.Tensor) -> None:
    chunk = full[unit.shard_slice]
    unit.master.data.copy_(chunk)
    if unit.shard is not None:
        unit.shard.copy_(chunk)
    if unit.full is not None and unit.state.value == "unsharded":
        unit.full.copy_(full)


@torch.no_grad()
def full_optimizer_state(engine: ZeroEngine, optimizer: torch.optim.Optimizer, keep: bool = True) -> dict[str, Any]:
    """The optimizer's state per original parameter name, plus its param-group hyper-parameters.

    As for :func:`full_model_state`, ranks without ``keep`` join the gathers and return ``{}``.
    """
    optimizer = _unwrap(optimizer)
    units = engine.units_for(optimizer)
    per_param: dict[str, dict[str, Any]] = {}
    elementwise: set[str] = set()  # state keys stored per element (exp_avg, ...), not scalars (step)
    for unit in units:
        local = optimizer.state.get(unit.master, {})
        for key, value in local.items():
            if isinstance(value, torch.Tensor) and value.numel() == unit.layout.shard_numel and value.dim() == 1:
                full = torch.empty(unit.layout.padded_numel, dtype=value.dtype, device=value.device)
                engine.comm.all_gather(full, value.contiguous())
                elementwise.add(key)
                if not keep:
                    continue
                for name, view in zip(unit.names, unit.views(full)):
                    per_param.setdefault(name, {})[key] = view.cpu().clone()
            else:  # scalars such as Adam's step are the same on every rank
                for name in unit.names:
                    per_param.setdefault(name, {})[key] = value.cpu().clone() if isinstance(value, torch.Tensor) \
                        else value
    k = units[0].group_index[0] if units else 0
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        names = engine.group_names.get((k, g), [])
        groups.append({**{key: v for key, v in group.items() if key != "params"}, "params": names})
    if not keep:
        return {}
    return {"format": FORMAT, "state": per_param, "param_groups": groups, "elementwise": sorted(elementwise)}


@torch.no_grad()
def load_optimizer_state(engine: ZeroEngine, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Slice a full optimizer state (any world size wrote it) into this rank's shard state."""
    optimizer = _unwrap(optimizer)
    if saved.get("format") != FORMAT:
        raise ValueError("This optimizer state was not written by lightning_zero (no 'format' marker); "
                         "resume it with the strategy that wrote it, or load only the weights.")
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"Checkpoint has {len(saved['param_groups'])} optimizer param groups, the optimizer "
                         f"has {len(optimizer.param_groups)}: configure_optimizers must build the same groups.")
    local_state: dict[int, dict[str, Any]] = {}
    elementwise = set(saved.get("elementwise", ()))
    index_of = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    for unit in engine.units_for(optimizer):
        entries = [saved["state"].get(name) for name in unit.names]
        present = [e for e in entries if e]
        if not present:
            continue
        out: dict[str, Any] = {}
        for key, sample in present[0].items():
            if key in elementwise:
                full = torch.zeros(unit.layout.padded_numel, dtype=sample.dtype)
                for entry, view in zip(entries, unit.views(full)):
                    if entry and key in entry:
                        view.copy_(entry[key].reshape(view.shape))
                out[key] = full[unit.shard_slice].clone()
            else:
                out[key] = sample
        local_state[index_of[id(unit.master)]] = out
    groups = [{**{k: v for k, v in sg.items() if k != "params"},
               "params": [index_of[id(p)] for p in g["params"]]}
              for sg, g in zip(saved["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({"state": local_state, "param_groups": groups})
