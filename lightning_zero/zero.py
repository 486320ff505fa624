"""``lightning_zero.zero``: DeepSpeed's ``deepspeed.zero.Init`` and ``deepspeed.zero.GatheredParameters``.

[Note: building a model too big for one rank]
``with zero.Init(): model = Model()`` builds the model's parameters on the meta device (no memory, no
values; buffers, and the parameters of modules without ``reset_parameters``, keep their constructor
values: see ``meta_parameters``) and remembers the random-number state at entry. ``initialize`` then materializes it module by
module on the training device from each module's ``reset_parameters()`` replayed from that state,
and shards each group as soon as it is complete (see [Note: initialization and seeds]), so no
rank ever holds the whole model and the values equal a normal build with the same seed. The
parameters have no values between the two calls: read or change them after ``initialize``,
inside ``GatheredParameters``.

``GatheredParameters(params, modifier_rank=r)`` hands every rank the full fp32 master values of
``params`` (in the parameters' dtype) for the duration of the block; with ``modifier_rank`` the
values rank ``r`` leaves there are broadcast and written into the fp32 masters and the shards
(so the next step trains from them; DeepSpeed's version leaves its fp32 master stale after
``initialize``). Every rank must enter the block: it gathers.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import nn

from .engine import ZeroEngine
from .engine.materialize import RngState, meta_parameters
from .engine.state import set_unit_values

__all__ = ["Init", "GatheredParameters", "init_rng_for"]

_last_init: list[Optional[RngState]] = [None]
_rng_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def init_rng_for(model: nn.Module) -> Optional[RngState]:
    """The random state ``Init`` saw when ``model`` was built (the last ``Init``'s when it is not known)."""
    return _rng_of.get(model, _last_init[0])


class Init:
    """Build models on the meta device; ``initialize`` materializes and shards them (see the module note).

    DeepSpeed's arguments are accepted; ``enabled=False`` builds normally. ``module=`` (an already built
    model) needs nothing: ``initialize`` shards it.
    """

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Any = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu: Any = None, **_: Any) -> None:
        self.enabled = enabled and module is None
        self._context: Any = None

    def __enter__(self) -> Init:
        if self.enabled:
            _last_init[0] = RngState()
            self._context = meta_parameters(torch.device("cpu"))  # buffers go to the device with the engine
            self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)
            self._context = None


def _as_list(params: Any) -> list[torch.Tensor]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    return [p for p in params if isinstance(p, torch.Tensor)] if isinstance(params, Iterable) else []


class GatheredParameters:
    """Full values of sharded parameters inside the block; with ``modifier_rank``, that rank's changes are kept."""

    def __init__(self, params: Any, modifier_rank: Optional[int] = None, fwd_module: Any = None,
                 enabled: bool = True, fp32: bool = False) -> None:
        self.params = _as_list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self.fp32 = fp32  # hand the fp32 master values themselves, whatever the parameters' dtype
        self._held: list[tuple[ZeroEngine, Any, dict[int, torch.Tensor], list[tuple[nn.Parameter, torch.Tensor, Optional[torch.Tensor]]]]] = []

    def __enter__(self) -> GatheredParameters:
        by_engine: dict[int, tuple[ZeroEngine, list[nn.Parameter]]] = {}
        for p in self.params:
            engine = ZeroEngine.owning(p)
            if engine is None:
                if p.is_meta:
                    raise RuntimeError(
                        "GatheredParameters got a parameter on the meta device: a model built under "
                        "lightning_zero.zero.Init() gets its values in initialize(). Gather or change parameters after "
                        "initialize(), or initialize them in the modules' reset_parameters().")
                continue  # not sharded: already whole, as DeepSpeed treats it
            by_engine.setdefault(id(engine), (engine, []))[1].append(p)
        for engine, params in by_engine.values():
            self._gather(engine, params)
        return self

    @torch.no_grad()
    def _gather(self, engine: ZeroEngine, params: list[nn.Parameter]) -> None:
        units = {id(engine.unit_of(p)): engine.unit_of(p) for p in params}
        fulls: dict[int, torch.Tensor] = {}
        for key, unit in units.items():
            full = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=engine.device)
            engine.comm.all_gather(full, unit.master.detach().to(engine.device), async_op=False)
            fulls[key] = full
        handed = []
        for p in params:
            unit, slot = engine.slot_of(p)
            view = unit.param_views(fulls[id(unit)])[slot]
            original = p.data  # its device is where the module is (after fit: moved to the CPU, as under DDP)
            p.data = view.to(device=original.device, dtype=torch.float32 if self.fp32 else p.dtype, copy=True)
            before = p.data.clone() if self.modifier_rank is not None and p.dtype != torch.float32 else None
            handed.append((p, original, before))
        self._held.append((engine, units, fulls, handed))

    @torch.no_grad()
    def __exit__(self, *exc: Any) -> None:
        held, self._held = self._held, []
        for engine, units, fulls, handed in held:
            if self.modifier_rank is not None and exc[0] is None:
                for p, _, before in handed:
                    if p.device == engine.device:
                        engine.comm.broadcast(p.data, src=self.modifier_rank)
                    else:  # the collective runs on the engine's device
                        p.data.copy_(engine.comm.broadcast(p.data.to(engine.device), src=self.modifier_rank))
                    if before is None or not torch.equal(p.data, before):  # untouched 16-bit values keep fp32 bits
                        unit, slot = engine.slot_of(p)
                        unit.param_views(fulls[id(unit)])[slot].copy_(p.data.float())
                for key, unit in units.items():
                    set_unit_values(unit, fulls[key])
            for p, original, _ in handed:
                p.data = original
            for unit in units.values():  # changes made in here are in the masters (or dropped): none is pending
                unit.forget_edits()
