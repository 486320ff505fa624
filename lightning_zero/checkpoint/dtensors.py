"""The engine's sharded state as DTensors: ``Shard(0)`` of each parameter on a 1-D DeviceMesh (``Replicate``
where every rank holds the fp32 values whole: stages 1/2 computing in fp32).

What ``strategy.lightning_module_state_dict()`` / ``optimizer_state()`` return in the sharded
format, in the layout FSDP2 and ``torch.distributed.checkpoint.state_dict`` use (parameter
names, parameter shapes, row chunks; the optimizer state keyed by parameter name), so
``.full_tensor()``, ``.to_local()``, elementwise math and DCP behave as torch documents.

ZeRO's pieces are not row chunks (see [Note: pieces and chunks]): building the DTensors moves
each element to the rank whose chunk holds it, one unit and one state key at a time through an
all-to-all on the host (a collective: every rank calls these). The result lives in host memory,
a copy of this rank's share (1/N of the state), except on one rank, where a chunk is the whole
parameter and the DTensors are views of the masters and moments themselves (no copy: a model
that fills the host is not duplicated to be saved).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch

from ..collectives import Comm
from ..engine import ZeroEngine
from ..engine.flat_unit import FlatUnit, UnitState
from ..engine.guard import allow_state_dict
from ..engine.optim import unwrap
from ..engine.state import cpu_copy, dtype_named, is_elementwise, keys_of
from .boxes import chunk_range, transfers

__all__ = ["model_state", "model_state_is_local", "optimizer_state", "piece_values", "gather_state_info"]


def piece_values(unit: FlatUnit, slot: int) -> Optional[torch.Tensor]:
    """This rank's piece of parameter ``slot`` of ``unit``: a 1-D view of the fp32 master (None: no piece here)."""
    piece = unit.spans[slot]
    return None if piece is None else unit.master.detach()[piece.shard_start:piece.shard_start + piece.length]


def _dtensor(comm: Comm, local: torch.Tensor, shape: torch.Size) -> Any:
    """A DTensor of global ``shape`` whose local part on this rank is ``local`` (its chunk, flat).

    Over a gloo group a GPU chunk becomes a host copy on the host mesh: torch's gloo backend cannot run the
    collectives a DTensor's ``full_tensor()`` or redistribution issue on CUDA tensors (it crashes the process,
    pytorch/pytorch#152645), and a gloo group's ranks reach each other through host memory anyway."""
    if local.device.type == "cuda" and comm.world_size > 1 and comm.backend == "gloo":
        local = local.detach().to("cpu")
    mesh = comm.mesh(local.device.type)
    if mesh is None:  # a plain process without torch.distributed: the whole tensor, as itself
        return local.view(shape)
    from torch.distributed.tensor import DTensor, Replicate, Shard

    lo, hi = chunk_range(shape, comm.rank, comm.world_size)
    rows = (hi - lo) // (math.prod(shape[1:]) or 1) if len(shape) else 0
    local_shape = (rows, *shape[1:]) if len(shape) else ()
    placements = [Shard(0)] if len(shape) else [Replicate()]
    strides = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.view(local_shape), mesh, placements, run_check=False, shape=shape, stride=strides)


def _replicated(comm: Comm, full: torch.Tensor) -> Any:
    """A DTensor every rank holds whole (``Replicate``): stages 1/2 in fp32, where each rank's parameter is the
    master itself. A norm or a sum read on one rank then is the parameter's own, as under DDP (of a ``Shard(0)``
    DTensor it would be a partial value that ``float()`` / ``.item()`` read without reducing), and
    torch.distributed.checkpoint writes it once."""
    if full.device.type == "cuda" and comm.backend == "gloo":  # see _dtensor
        full = full.detach().to("cpu")
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(full, comm.mesh(full.device.type), [Replicate()], run_check=False)


def _exchange(comm: Comm, unit: FlatUnit, slots: list[int], values: Callable[[int], Optional[torch.Tensor]],
              dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """Every rank's ``Shard(0)`` chunk (flat) of each of ``slots``, from the pieces ``values(slot)``."""
    if comm.world_size == 1:  # the piece is the whole parameter: no move, no copy
        return {s: values(s) for s in slots if unit.layout.slots[s].numel}
    plan = []
    for slot in slots:
        if not unit.layout.slots[slot].numel:
            continue
        ranges: list[Optional[tuple[int, int]]] = [None] * comm.world_size
        for rank in range(comm.world_size):
            for piece in unit.layout.pieces(rank):
                if piece.index == slot:
                    ranges[rank] = (piece.param_start, piece.param_start + piece.length)
        plan += transfers(unit.shapes[slot], ranges, comm.world_size, slot)
    sends = sorted((t for t in plan if t.src == comm.rank), key=lambda t: t.dst)  # stable: slot order kept
    recvs = sorted((t for t in plan if t.dst == comm.rank), key=lambda t: t.src)
    send = torch.empty(sum(t.length for t in sends), dtype=dtype)
    pos, host = 0, {}
    for t in sends:
        if t.slot not in host:
            host[t.slot] = values(t.slot).detach().reshape(-1).to("cpu", dtype)
        start = t.param_start - unit.spans[t.slot].param_start
        send[pos:pos + t.length].copy_(host[t.slot][start:start + t.length])
        pos += t.length
    host.clear()
    recv = torch.empty(sum(t.length for t in recvs), dtype=dtype)
    comm.all_to_all_host(recv, send, [sum(t.length for t in recvs if t.src == r) for r in range(comm.world_size)],
                         [sum(t.length for t in sends if t.dst == r) for r in range(comm.world_size)])
    out = {}
    for slot in slots:
        lo, hi = chunk_range(unit.shapes[slot], comm.rank, comm.world_size)
        if unit.layout.slots[slot].numel:
            out[slot] = torch.empty(hi - lo, dtype=dtype)
    pos = 0
    for t in recvs:
        lo, _ = chunk_range(unit.shapes[t.slot], comm.rank, comm.world_size)
        out[t.slot][t.param_start - lo:t.param_start - lo + t.length].copy_(recv[pos:pos + t.length])
        pos += t.length
    return out


def _holds_fp32_values(unit: FlatUnit) -> bool:
    """Stages 1/2 with fp32 compute: the unit's gathered buffer holds every parameter's master values
    (the masters are views of it), so any rank's chunk is a view of it."""
    return unit.full is not None and unit.full.dtype == torch.float32 and unit.state is UnitState.UNSHARDED \
        and bool(unit.views)


def model_state_is_local(engine: ZeroEngine) -> bool:
    """Whether :func:`model_state` runs without a collective (one rank, or stages 1/2 computing in fp32):
    then a callback may call it on one rank."""
    return engine.comm.world_size == 1 or all(_holds_fp32_values(u) for u in engine.units)


@torch.no_grad()
def model_state(engine: ZeroEngine) -> dict[str, Any]:
    """The module's state dict: each managed parameter a DTensor of its fp32 master (every tied name the
    same object); buffers, parameters lightning_zero does not manage and extra state as the module holds them.
    A collective unless :func:`model_state_is_local`."""
    with allow_state_dict():
        full = engine.module.state_dict(keep_vars=True)
    keys = keys_of(engine.module)
    managed: dict[str, Any] = {}
    local = model_state_is_local(engine)
    replicated = local and engine.comm.world_size > 1  # every rank holds each parameter's fp32 values whole
    for unit in engine.units:
        slots = list(range(len(unit.params)))
        if replicated:
            chunks = {s: v.detach() for s, v in enumerate(unit.views) if unit.layout.slots[s].numel}
        else:
            chunks = _exchange(engine.comm, unit, slots, lambda s, u=unit: piece_values(u, s), torch.float32)
        for slot, param in enumerate(unit.params):
            if slot in chunks and replicated:
                value = _replicated(engine.comm, chunks[slot])
            elif slot in chunks:
                value = _dtensor(engine.comm, chunks[slot], torch.Size(unit.shapes[slot]))
            else:  # a parameter without elements
                value = param.detach()
            for key in keys[id(param)]:
                managed[key] = value
    return {k: managed[k] if k in managed else (v.detach() if isinstance(v, torch.Tensor) else v)
            for k, v in full.items()}


def gather_state_info(engine: ZeroEngine, optimizer: Any) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, Any]]]:
    """(elementwise, scalars) of every parameter of ``optimizer`` on any rank: name -> {key: dtype name} for
    per-element state (exp_avg, ...), name -> {key: value} for the rest (step). A collective."""
    local: dict[str, dict[str, Any]] = {}
    for unit, slot in engine.slots_of(optimizer):
        piece = unit.pieces[slot]
        entry = optimizer.state.get(piece) if piece is not None else None
        if entry:
            local[unit.names[slot]] = {k: (str(v.dtype) if is_elementwise(k, v, piece.numel()) else cpu_copy(v))
                                       for k, v in entry.items()}
    merged: dict[str, dict[str, Any]] = {}
    for part in engine.comm.all_gather_object(local):
        for name, entry in part.items():
            merged.setdefault(name, {}).update(entry)
    elementwise = {n: {k: v for k, v in e.items() if isinstance(v, str)} for n, e in merged.items()}
    scalars = {n: {k: v for k, v in e.items() if not isinstance(v, str)} for n, e in merged.items()}
    return elementwise, scalars


def param_groups(engine: ZeroEngine, optimizer: Any) -> list[dict[str, Any]]:
    """``param_groups`` with each group's parameters by name (as ``get_optimizer_state_dict`` gives them)."""
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [engine.names[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups]


@torch.no_grad()
def optimizer_state(engine: ZeroEngine, optimizer: Any,
                    make: Optional[Callable[..., Any]] = None) -> dict[str, Any]:
    """torch's optimizer state keyed by parameter name: per-element state as DTensors (by default; ``make``
    builds another representation from each piece), scalars (step) as plain tensors. A collective."""
    optimizer = unwrap(optimizer)
    elementwise, scalars = gather_state_info(engine, optimizer)
    by_unit: dict[int, tuple[FlatUnit, list[int]]] = {}
    for unit, slot in engine.slots_of(optimizer):
        by_unit.setdefault(id(unit), (unit, []))[1].append(slot)
    state: dict[str, dict[str, Any]] = {}
    for unit, slots in by_unit.values():
        keys = sorted({(k, d) for s in slots for k, d in elementwise.get(unit.names[s], {}).items()})
        for key, dtype_name in keys:
            dtype = dtype_named(dtype_name)
            having = [s for s in slots if key in elementwise.get(unit.names[s], {})]

            def values(slot: int, unit: FlatUnit = unit, key: str = key, dtype: torch.dtype = dtype
                       ) -> Optional[torch.Tensor]:
                piece = unit.pieces[slot]
                if piece is None:
                    return None
                value = optimizer.state.get(piece, {}).get(key)
                return value.detach().reshape(-1) if value is not None else torch.zeros(piece.numel(), dtype=dtype)

            if make is not None:
                for slot in having:
                    state.setdefault(unit.names[slot], {})[key] = make(unit, slot, values(slot), dtype)
                continue
            chunks = _exchange(engine.comm, unit, having, values, dtype)
            for slot in having:
                if slot in chunks:
                    value = _dtensor(engine.comm, chunks[slot], torch.Size(unit.shapes[slot]))
                    state.setdefault(unit.names[slot], {})[key] = value
    for name, entry in scalars.items():
        for key, value in entry.items():
            state.setdefault(name, {})[key] = value
    ordered = [engine.names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {"state": {n: state[n] for n in ordered if n in state}, "param_groups": param_groups(engine, optimizer)}
