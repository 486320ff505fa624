"""Sharded checkpoints: each rank writes and reads only its own pieces, through DCP.

Layout of a directory (see [Note: one flat tensor per parameter] and [Note: atomic directories]):
- ``model/<name>``: a managed parameter as one flat fp32 tensor (its master values), or a buffer /
  unmanaged parameter as itself (identical on every rank, so DCP stores one copy);
- ``optim/<i>/<name>/<key>``: optimizer ``i``'s per-element state of a parameter (exp_avg, ...), flat;
- ``meta.pt``: everything else Lightning saves (loops, callbacks, schedulers, loss scaler), the
  optimizers' param groups and per-parameter scalars (``step``), the parameters' shapes and tied
  aliases. Small, written by rank 0.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ..collectives import Comm
from ..engine import ZeroEngine
from ..engine.guard import allow_state_dict
from ..engine.optim import unwrap
from ..engine.state import check_keys, cpu_copy, is_elementwise, torch_param_groups
from . import checksums
from .files import DCP_METADATA, META_FILE, CheckpointPathError, check_complete, commit, partial_path, prepare_partial
from .shards import param_shards, sharded_piece

__all__ = ["FORMAT", "SavedState", "model_shards", "optimizer_shards", "describe_model", "save", "read",
           "load_into_module", "load_into_engine", "load_optimizer", "MODEL", "OPTIM"]

FORMAT = "lightning_zero.sharded.v1"
MODEL, OPTIM = "model/", "optim/"


class SavedState(dict):
    """Stands for a part of a sharded checkpoint that is read straight into the engine's shards.

    An optimizer's holds its ``param_groups`` and names (what an ``on_load_checkpoint`` hook may
    read); its per-parameter tensors stay on disk until the strategy loads them into the pieces.
    """

    def __init__(self, path: Path, meta: dict[str, Any], metadata: Any, index: Optional[int] = None) -> None:
        super().__init__({} if index is None else meta["optimizer_states"][index])
        self.path, self.meta, self.metadata, self.index = path, meta, metadata, index

    def __repr__(self) -> str:
        what = "model" if self.index is None else f"optimizer {self.index}"
        return f"SavedState({what} in {self.path})"


# ---- save ------------------------------------------------------------------------------------------
def _keys_of(module: nn.Module) -> dict[int, list[str]]:
    keys: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        keys.setdefault(id(p), []).append(name)
    return keys


def _piece_values(unit: Any, slot: int) -> Optional[torch.Tensor]:
    piece = unit.spans[slot]
    return None if piece is None else unit.master.detach()[piece.shard_start:piece.shard_start + piece.length]


@torch.no_grad()
def model_shards(engine: ZeroEngine) -> dict[str, Any]:
    """The module's state dict with every managed parameter as a ShardedTensor of this rank's master piece."""
    with allow_state_dict():
        full = engine.module.state_dict(keep_vars=True)
    managed = {id(p) for u in engine.units for p in u.params}
    # Buffers (BatchNorm statistics) drift apart between ranks after each forward, until the next training
    # forward takes rank 0's (as DDP): the checkpoint holds rank 0's, as a DDP checkpoint does. Written by
    # every rank, DCP would spread the replicated entries over the writers and mix ranks' values.
    keep_plain = engine.comm.rank == 0
    out: dict[str, Any] = {k: v.detach() if isinstance(v, torch.Tensor) else v
                           for k, v in full.items() if not (isinstance(v, torch.Tensor) and id(v) in managed)
                           and (keep_plain or not isinstance(v, torch.Tensor))}
    for unit in engine.units:
        for slot, name in enumerate(unit.names):
            numel = unit.layout.slots[slot].numel
            if numel:
                out[name] = sharded_piece(_piece_values(unit, slot), numel, param_shards(unit.layout, slot),
                                          unit.rank, torch.float32)
    return out


def describe_model(engine: ZeroEngine) -> dict[str, Any]:
    """Shapes of the managed parameters and the other names tied parameters have (for meta.pt)."""
    keys = _keys_of(engine.module)
    params, aliases = {}, {}
    for unit in engine.units:
        for param, name, shape in zip(unit.params, unit.names, unit.shapes):
            params[name] = list(shape)
            aliases.update({alias: name for alias in keys[id(param)] if alias != name})
    return {"format": FORMAT, "params": params, "aliases": aliases, "world_size": engine.comm.world_size,
            "stage": engine.config.stage}


@torch.no_grad()
def optimizer_shards(engine: ZeroEngine, optimizer: Any) -> dict[str, Any]:
    """The optimizer's state with per-element tensors as ShardedTensors (a collective: all ranks call it)."""
    optimizer = unwrap(optimizer)
    slots = engine.slots_of(optimizer)
    local: dict[str, dict[str, Any]] = {}
    for unit, slot in slots:
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
    state: dict[str, dict[str, Any]] = {}
    for unit, slot in slots:
        name, piece = unit.names[slot], unit.pieces[slot]
        numel = unit.layout.slots[slot].numel
        for key, dtype_name in elementwise.get(name, {}).items():
            dtype = _dtype(dtype_name)
            value = None
            if piece is not None:
                value = optimizer.state.get(piece, {}).get(key)
                value = value.detach().reshape(-1) if value is not None else torch.zeros(piece.numel(), dtype=dtype)
            state.setdefault(name, {})[key] = sharded_piece(value, numel, param_shards(unit.layout, slot),
                                                            unit.rank, dtype)
    groups, names = torch_param_groups(engine, optimizer)
    return {"state": state, "param_groups": groups,
            "lightning_zero": {"format": FORMAT, "param_names": names, "elementwise": elementwise,
                               "scalars": scalars}}


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.split(".")[-1])


def _split(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors for DCP, the rest for meta.pt)."""
    tensors: dict[str, Any] = {}
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    extra = {}
    for key, value in checkpoint.get("state_dict", {}).items():
        if isinstance(value, torch.Tensor):
            tensors[MODEL + key] = value
        else:
            extra[key] = value
    meta["state_dict_extra"] = extra
    if "optimizer_states" in checkpoint:
        meta["optimizer_states"] = []
        for i, opt in enumerate(checkpoint["optimizer_states"]):
            for name, entry in opt.get("state", {}).items():
                for key, value in entry.items():
                    tensors[f"{OPTIM}{i}/{name}/{key}"] = value
            meta["optimizer_states"].append({k: v for k, v in opt.items() if k != "state"})
    return tensors, meta


# [Note: one file per tensor]
# DCP's writer keeps every tensor of a file in host memory until the file is closed (torch 2.11-2.13),
# and pieces on the GPU are first copied to the host. With one file per rank that is the rank's whole
# state in RAM (measured: +16 GiB to save 1.3B parameters on an H200); with one file per tensor it is
# one tensor per writer thread. Several threads write in parallel.
_WRITER_THREADS = 4


def save(checkpoint: dict[str, Any], path: Any, comm: Comm, describe: dict[str, Any]) -> None:
    """Write ``checkpoint`` (from :func:`model_shards` / :func:`optimizer_shards`) as directory ``path``.

    A collective: every rank writes its own pieces in parallel, rank 0 the small ``meta.pt``.
    """
    path = Path(path)
    error = None
    if comm.rank == 0:
        try:
            prepare_partial(path)
        except CheckpointPathError as err:
            error = str(err)
    error = comm.all_gather_object(error)[0]
    if error:
        raise CheckpointPathError(error)
    tensors, meta = _split(checkpoint)
    meta["lightning_zero"] = describe
    partial = partial_path(path)
    with _quiet():
        comm.dcp_save(tensors, dcp.FileSystemWriter(str(partial), single_file_per_rank=False,
                                                    thread_count=_WRITER_THREADS))
    written = checksums.file_checksums(sorted(partial.glob(f"__{comm.rank}_*.distcp")))  # see [Note: why checksums]
    written = comm.all_gather_object(written)
    if comm.rank == 0:
        torch.save(meta, partial / META_FILE)
        entries = {name: value for part in written for name, value in part.items()}
        entries.update(checksums.file_checksums([partial / META_FILE, partial / DCP_METADATA]))
        checksums.write(partial, entries)
        commit(path)
    comm.all_gather_object(None)  # every rank returns once the directory is in place


# ---- load --------------------------------------------------------------------------------------------
def read(path: Any, comm: Optional[Comm] = None) -> dict[str, Any]:
    """The checkpoint dict Lightning restores from: meta.pt's content, with the tensors still on disk.
    With ``comm`` every rank of it must call this (they share the checksum work); without, this process
    checks every file."""
    path = Path(path)
    verify_checksums(path, comm)
    metadata = check_complete(path)
    meta = load_meta(path)
    if meta.get("lightning_zero", {}).get("format") != FORMAT:
        raise CheckpointPathError(f"{path} is not a lightning_zero sharded checkpoint (its meta.pt has no "
                                  f"'{FORMAT}' marker); load it with the tool that wrote it.")
    checkpoint = dict(meta)
    checkpoint["state_dict"] = SavedState(path, meta, metadata)
    if "optimizer_states" in meta:
        checkpoint["optimizer_states"] = [SavedState(path, meta, metadata, i) for i in range(len(meta["optimizer_states"]))]
    return checkpoint


def verify_checksums(path: Path, comm: Optional[Comm] = None) -> None:
    """With ``comm`` (every rank of it calls this) each rank checks its share of the files against
    ``checksums.json`` and all agree on the verdict; without, this process checks them all.
    See [Note: why checksums]."""
    if not path.is_dir():
        return  # check_complete names what is wrong with the path
    if comm is not None and comm.world_size > 1:
        problems = comm.all_gather_object(checksums.verify(path, (comm.rank, comm.world_size)))
        checksums.raise_problem(next((p for p in problems if p), None))
    else:
        checksums.raise_problem(checksums.verify(path))


def load_meta(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - a truncated or overwritten file: name it
        raise CheckpointPathError(f"Checkpoint {path}: {META_FILE} is damaged ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0] if str(err) else ''}). Resume from an earlier checkpoint "
                                  f"or copy the whole directory again.") from None


def _saved_model_keys(saved: SavedState) -> dict[str, str]:
    """Every state-dict key the checkpoint holds -> the DCP key holding its values (tied aliases included)."""
    keys = {k[len(MODEL):]: k for k in saved.metadata.state_dict_metadata if k.startswith(MODEL)}
    for alias, name in saved.meta["lightning_zero"]["aliases"].items():
        if name in keys:
            keys[alias] = keys[name]
    return keys


def _check_keys(saved: SavedState, expected: set[str], strict: bool) -> dict[str, str]:
    have = _saved_model_keys(saved)
    have.update({k: "" for k in saved.meta.get("state_dict_extra", {})})
    if strict:
        check_keys(expected, have.keys(), saved.path)
    return have


def _saved_shape(saved: SavedState, key: str) -> torch.Size:
    name = key[len(MODEL):]
    shape = saved.meta["lightning_zero"]["params"].get(name)
    return torch.Size(shape) if shape is not None else saved.metadata.state_dict_metadata[key].size


@torch.no_grad()
def load_into_module(saved: SavedState, module: nn.Module) -> dict[str, Any]:
    """Before setup: read the saved weights into the module's own tensors (in place, no copy of the model)
    and return them as the checkpoint's state dict (what a module's ``on_load_checkpoint`` sees)."""
    own = module.state_dict(keep_vars=True)
    targets, out = {}, {}
    dcp_key = _saved_model_keys(saved)
    for name, key in dcp_key.items():
        if key in targets:
            continue
        md = saved.metadata.state_dict_metadata[key]
        if not hasattr(md, "size"):
            continue
        mine = own.get(name)
        if (isinstance(mine, torch.Tensor) and mine.numel() == md.size.numel() and mine.is_contiguous()
                and mine.device.type != "meta"):
            targets[key] = mine.detach().view(md.size)
        else:
            targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
    _load(targets, saved.path)
    for name, key in dcp_key.items():
        if key in targets:
            out[name] = targets[key].view(_saved_shape(saved, key))
    out.update(saved.meta.get("state_dict_extra", {}))
    return out


@torch.no_grad()
def load_into_engine(saved: SavedState, engine: ZeroEngine, strict: bool = True) -> None:
    """After setup: every rank reads only its own pieces into its fp32 masters (any saving world size)."""
    module = engine.module
    with allow_state_dict():
        expected = set(module.state_dict(keep_vars=True).keys())
    have = _check_keys(saved, expected, strict)
    keys = _keys_of(module)
    targets: dict[str, Any] = {}
    managed = set()
    for unit in engine.units:
        for slot, param in enumerate(unit.params):
            managed.add(id(param))
            key = next((have[k] for k in keys[id(param)] if have.get(k)), None)
            numel = unit.layout.slots[slot].numel
            if key is None or not numel:
                continue
            targets[key] = sharded_piece(_piece_values(unit, slot), numel, param_shards(unit.layout, slot),
                                         unit.rank, torch.float32)
    with allow_state_dict():
        plain = module.state_dict(keep_vars=True)
    for name, value in plain.items():
        key = have.get(name)
        if key and isinstance(value, torch.Tensor) and id(value) not in managed and key not in targets:
            targets[key] = value.detach().view(saved.metadata.state_dict_metadata[key].size)
    _load(targets, saved.path, engine.comm)
    engine.republish()


@torch.no_grad()
def load_optimizer(saved: SavedState, engine: ZeroEngine, optimizer: Any) -> None:
    """Read optimizer ``saved.index``'s state into this rank's pieces (any saving world size or stage)."""
    optimizer = unwrap(optimizer)
    info = saved.meta["optimizer_states"][saved.index]
    lz = info["lightning_zero"]
    if len(info["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"Checkpoint {saved.path} has {len(info['param_groups'])} param groups for optimizer "
                         f"{saved.index}, the optimizer has {len(optimizer.param_groups)}: configure_optimizers must "
                         f"build the same groups.")
    slots = engine.slots_of(optimizer)
    lacking = [unit.names[s] for unit, s in slots if unit.names[s] not in set(lz["param_names"])]
    if lacking:
        raise ValueError(f"Checkpoint {saved.path} has no optimizer state for {lacking[:5]}: it was written for "
                         f"another model or other parameter groups.")
    for group, saved_group in zip(optimizer.param_groups, info["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    targets: dict[str, Any] = {}
    for unit, slot in slots:
        name, piece = unit.names[slot], unit.pieces[slot]
        numel = unit.layout.slots[slot].numel
        entry: dict[str, Any] = {}
        for key, dtype_name in lz["elementwise"].get(name, {}).items():
            dcp_key = f"{OPTIM}{saved.index}/{name}/{key}"
            if dcp_key not in saved.metadata.state_dict_metadata:
                raise CheckpointPathError(f"Checkpoint {saved.path} is incomplete: no '{dcp_key}'. Resume from an "
                                          f"earlier checkpoint.")
            dtype = _dtype(dtype_name)
            local = torch.empty(piece.numel(), dtype=dtype, device=piece.device) if piece is not None else None
            targets[dcp_key] = sharded_piece(local, numel, param_shards(unit.layout, slot), unit.rank, dtype)
            if local is not None:
                entry[key] = local
        if piece is None:
            continue
        group = group_of[id(unit.params[slot])]
        for key, value in lz["scalars"].get(name, {}).items():
            if key == "step" and isinstance(value, torch.Tensor) and (group.get("fused") or group.get("capturable")):
                entry[key] = value.to(device=piece.device, dtype=torch.float32)  # fused kernels want it there
            else:
                entry[key] = cpu_copy(value)
        if entry:
            optimizer.state[piece] = entry
    _load(targets, saved.path, engine.comm)


@contextmanager
def _quiet() -> Iterator[None]:
    # DCP warns on every ShardedTensor that DTensor replaces it; DTensor cannot express ZeRO's pieces
    # (arbitrary offsets inside a parameter), and ShardedTensor is read and written by torch 2.11-2.13.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning)
        yield


def _load(targets: dict[str, Any], path: Path, comm: Optional[Comm] = None) -> None:
    """Read ``targets`` from ``path``: over the engine's group, or (before setup, no engine yet) the default one."""
    reader = dcp.FileSystemReader(str(path))
    try:
        with _quiet():
            if comm is not None:
                comm.dcp_load(targets, reader)
            else:
                dcp.load(targets, storage_reader=reader)
    except Exception as err:  # DCP wraps each rank's failure; name the checkpoint and the way out
        raise CheckpointPathError(f"Reading checkpoint {path} failed: {str(err).splitlines()[0]}. If it was copied "
                                  f"or is still being written, copy the whole directory again.") from err

