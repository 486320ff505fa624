"""Sharded checkpoints: a ``torch.distributed.checkpoint`` directory in Lightning's own distributed layout.

Layout of a directory (the one Lightning's ``ModelParallelStrategy`` writes for FSDP2, so each
strategy resumes the other's; see [Note: atomic directories]):
- ``state_dict.<name>``: the module's state dict, each parameter with its own shape (fp32 master
  values), buffers and extra state as they are;
- ``optimizer_<i>.state.<name>.<key>`` / ``optimizer_<i>.param_groups...``: optimizer ``i`` as
  ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` gives it (keyed by
  parameter name; per-element state shaped like the parameter, ``step`` a scalar);
- ``meta.pt``: everything else Lightning saves (loops, callbacks, schedulers, loss scaler) and, under
  ``"lightning_zero"``, the parameter shapes and tied names and which optimizer state is per element.

DCP stores each rank's part with its offsets and on load copies the overlap between the saved parts
and the loading ranks' parts, so any world size, any stage and FSDP2 read the same directory; a rank
reads and writes its part straight into and out of its fp32 master and optimizer pieces
(:class:`.pieces.PieceTensor`). ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``
turns a directory into one file whose ``["state_dict"]`` loads into the bare module.

Directories of the first format (``lightning_zero.sharded.v1``: flat ``model/<name>`` and
``optim/<i>/<name>/<key>`` tensors, param groups in ``meta.pt``) still load.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..collectives import Comm
from ..engine import ZeroEngine
from ..engine.guard import allow_state_dict
from ..engine.optim import unwrap
from ..engine.state import check_keys, check_same_optimizer, cpu_copy, keys_of, optimizer_class
from . import checksums
from .dtensors import optimizer_state, piece_values
from .files import DCP_METADATA, META_FILE, CheckpointPathError, check_complete, commit, partial_path, prepare_partial
from .pieces import PieceTensor

__all__ = ["FORMAT", "FORMAT_V1", "SavedState", "Layout", "model_pieces", "optimizer_pieces", "describe_model",
           "save", "read", "load_into_module", "load_into_engine", "load_optimizer", "MODEL"]

FORMAT = "lightning_zero.sharded.v2"
FORMAT_V1 = "lightning_zero.sharded.v1"
MODEL = "state_dict."
# Top-level entries that hold a module state dict. Lightning's WeightAveraging (EMA) moves the module's own
# state (our pieces) to "current_model_state" when it saves, and puts its average in "state_dict".
MODEL_STATES = ("state_dict", "current_model_state")
_V1_MODEL, _V1_OPTIM = "model/", "optim/"


def _is_part(value: Any) -> bool:
    """A value that each rank holds a different part of (the others are the same on every rank)."""
    from torch.distributed.tensor import DTensor

    return isinstance(value, (DTensor, PieceTensor))


# ---- save ------------------------------------------------------------------------------------------
@torch.no_grad()
def model_pieces(engine: ZeroEngine) -> dict[str, Any]:
    """The module's state dict with each managed parameter as this rank's piece of its master, in place
    (no copy and no collective): what the DeepSpeed-style engine saves."""
    with allow_state_dict():
        full = engine.module.state_dict(keep_vars=True)
    keys = keys_of(engine.module)
    managed: dict[str, Any] = {}
    for unit in engine.units:
        for slot, param in enumerate(unit.params):
            piece = unit.spans[slot]
            value = PieceTensor(piece_values(unit, slot), unit.shapes[slot], piece.param_start if piece else 0,
                                torch.float32)
            managed.update({key: value for key in keys[id(param)]})
    return {k: managed.get(k, v.detach() if isinstance(v, torch.Tensor) else v) for k, v in full.items()}


def optimizer_pieces(engine: ZeroEngine, optimizer: Any) -> dict[str, Any]:
    """An optimizer's state with per-element state as this rank's pieces, in place (all ranks call it)."""
    def make(unit: Any, slot: int, values: Optional[torch.Tensor], dtype: torch.dtype) -> PieceTensor:
        piece = unit.spans[slot]
        return PieceTensor(values, unit.shapes[slot], piece.param_start if piece else 0, dtype)

    return optimizer_state(engine, optimizer, make=make)


def describe_model(engine: ZeroEngine) -> dict[str, Any]:
    """Shapes of the managed parameters and the other names tied parameters have (for meta.pt)."""
    keys = keys_of(engine.module)
    params, aliases = {}, {}
    for unit in engine.units:
        for param, name, shape in zip(unit.params, unit.names, unit.shapes):
            params[name] = list(shape)
            aliases.update({alias: name for alias in keys[id(param)] if alias != name})
    return {"format": FORMAT, "params": params, "aliases": aliases, "world_size": engine.comm.world_size,
            "stage": engine.config.stage, "optimizer_classes": [optimizer_class(o) for o in engine.optimizers]}


def _split(checkpoint: dict[str, Any], rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what DCP writes, the rest for meta.pt). Values every rank holds alike are written by rank 0 alone:
    buffers drift apart between ranks until the next training forward takes rank 0's (as DDP does), and a
    checkpoint holds rank 0's, as a DDP checkpoint does (DCP would spread them over the writers)."""
    meta = {k: v for k, v in checkpoint.items() if k not in MODEL_STATES + ("optimizer_states",)}
    tensors: dict[str, Any] = {}
    for top in MODEL_STATES:
        if top in checkpoint or top == "state_dict":
            tensors[top] = {k: v for k, v in checkpoint.get(top, {}).items() if rank == 0 or _is_part(v)}
    optimizers = []
    for i, opt in enumerate(checkpoint.get("optimizer_states", [])):
        tensors[f"optimizer_{i}"] = opt
        optimizers.append({"elementwise": {name: {k: str(v.dtype) for k, v in entry.items() if _is_part(v)}
                                           for name, entry in opt.get("state", {}).items()}})
    meta["_optimizers"] = optimizers
    meta["_model_states"] = [top for top in MODEL_STATES if top in tensors]
    return tensors, meta


# [Note: one file per tensor]
# DCP's writer keeps every tensor of a file in host memory until the file is closed (torch 2.11-2.13),
# and pieces on the GPU are first copied to the host. With one file per rank that is the rank's whole
# state in RAM (measured: +16 GiB to save 1.3B parameters on an H200); with one file per tensor it is
# one tensor per writer thread. Several threads write in parallel.
_WRITER_THREADS = 4


def save(checkpoint: dict[str, Any], path: Any, comm: Comm, describe: dict[str, Any]) -> None:
    """Write ``checkpoint`` (its state dict and optimizer states as DTensors or pieces) as directory ``path``.

    A collective: every rank writes its own parts in parallel, rank 0 the small ``meta.pt``.
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
    tensors, meta = _split(checkpoint, comm.rank)
    meta["lightning_zero"] = {**describe, "optimizers": meta.pop("_optimizers"), "model_states": meta.pop("_model_states")}
    partial = partial_path(path)
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


# ---- what a directory holds --------------------------------------------------------------------------
class Layout:
    """Where a directory keeps each value: ours (v2, and v1 before it) or Lightning's FSDP2 strategy's."""

    def __init__(self, path: Path, meta: dict[str, Any], metadata: Any) -> None:
        self.path, self.meta, self.metadata = path, meta, metadata
        self.lz = meta.get("lightning_zero", {})
        self.v1 = self.lz.get("format") == FORMAT_V1
        self.entries = metadata.state_dict_metadata
        self.paths = dict(getattr(metadata, "planner_data", None) or {})  # DCP key -> its path in the saved dict
        self._model_keys: Optional[dict[str, str]] = None

    def _path(self, key: str) -> tuple:
        return tuple(self.paths.get(key, ()))

    # model
    def model_keys(self) -> dict[str, str]:
        """Every state-dict key the directory holds -> the DCP key of its value (tied names included)."""
        if self._model_keys is None:
            self._model_keys = self._find_model_keys()
        return dict(self._model_keys)

    def _find_model_keys(self) -> dict[str, str]:
        if self.v1:
            keys = {k[len(_V1_MODEL):]: k for k in self.entries if k.startswith(_V1_MODEL)}
            keys.update({k: "" for k in self.meta.get("state_dict_extra", {})})
        else:
            keys = {}
            for key in self.entries:
                path = self._path(key)
                if len(path) == 2 and path[0] == "state_dict":
                    keys[path[1]] = key
                elif not path and key.startswith(MODEL):
                    keys[key[len(MODEL):]] = key
        for alias, name in self.lz.get("aliases", {}).items():
            if name in keys and alias not in keys:
                keys[alias] = keys[name]
        return keys

    def keys_under(self, top: str) -> dict[str, str]:
        """Like :meth:`model_keys` for another saved state dict (``MODEL_STATES``)."""
        keys = {path[1]: key for key, path in ((k, self._path(k)) for k in self.entries)
                if len(path) == 2 and path[0] == top}
        for alias, name in self.lz.get("aliases", {}).items():
            if name in keys and alias not in keys:
                keys[alias] = keys[name]
        return keys

    def shape(self, key: str, name: str) -> torch.Size:
        name = self.lz.get("aliases", {}).get(name, name)
        shape = self.lz.get("params", {}).get(name)
        return torch.Size(shape) if shape is not None else self.entries[key].size

    def is_tensor(self, key: str) -> bool:
        return isinstance(self.entries.get(key), TensorStorageMetadata)

    # optimizers
    def optimizer_count(self) -> int:
        if self.v1:
            return len(self.meta.get("optimizer_states", []))
        found = {int(p[0][len("optimizer_"):]) for p in (self._path(k) for k in self.entries)
                 if p and isinstance(p[0], str) and p[0].startswith("optimizer_") and p[0][10:].isdigit()}
        return max(found) + 1 if found else 0

    def optimizer_class(self, index: int) -> Optional[str]:
        """The class of the optimizer that wrote optimizer ``index``'s state (None: not recorded)."""
        classes = self.lz.get("optimizer_classes") or []
        return classes[index] if len(classes) == self.optimizer_count() else None

    def param_groups(self, index: int) -> list[dict[str, Any]]:
        """Optimizer ``index``'s param groups, each group's parameters by name."""
        if self.v1:
            info = self.meta["optimizer_states"][index]
            names = info["lightning_zero"]["param_names"]
            return [{**g, "params": [names[i] for i in g["params"]]} for g in info["param_groups"]]
        wanted = {k: p for k, p in ((k, self._path(k)) for k in self.entries)
                  if len(p) >= 3 and p[0] == f"optimizer_{index}" and p[1] == "param_groups"
                  and isinstance(self.entries[k], BytesStorageMetadata)}
        values = read_objects(self.path, list(wanted))
        groups: dict[int, dict[str, Any]] = {}
        for key, path in wanted.items():
            groups.setdefault(int(path[2]), {})[path[3]] = values[key]
        return [groups[g] for g in sorted(groups)]

    def optimizer_entries(self, index: int) -> dict[str, dict[str, tuple[str, Any]]]:
        """name -> {state key: ("part", DCP key) for per-element state, ("scalar", DCP key or value) otherwise}."""
        out: dict[str, dict[str, tuple[str, Any]]] = {}
        if self.v1:
            lz = self.meta["optimizer_states"][index]["lightning_zero"]
            for name, keys in lz["elementwise"].items():
                for key in keys:
                    out.setdefault(name, {})[key] = ("part", f"{_V1_OPTIM}{index}/{name}/{key}")
            for name, values in lz["scalars"].items():
                for key, value in values.items():
                    out.setdefault(name, {})[key] = ("scalar", value)
            return out
        listed = (self.lz.get("optimizers") or [{}] * (index + 1))[index].get("elementwise") if self.lz else None
        shapes = self.lz.get("params", {})
        for key in self.entries:
            path = self._path(key)
            if len(path) != 4 or path[0] != f"optimizer_{index}" or path[1] != "state":
                continue
            name, state_key = path[2], path[3]
            md = self.entries[key]
            if listed is not None:
                part = state_key in listed.get(name, {})
            else:  # another writer (FSDP2): per-element state is shaped like its parameter
                part = (isinstance(md, TensorStorageMetadata) and state_key != "step"
                        and md.size == torch.Size(shapes.get(name, self._param_shape(name))))
            out.setdefault(name, {})[state_key] = ("part" if part else "scalar", key)
        return out

    def _param_shape(self, name: str) -> Optional[torch.Size]:
        key = self.model_keys().get(name)
        return self.entries[key].size if key and self.is_tensor(key) else None


def read_objects(path: Path, keys: list[str]) -> dict[str, Any]:
    """Non-tensor values (param groups, extra state) of ``keys`` from the directory, in this process."""
    if not keys:
        return {}
    out: dict[str, Any] = dict.fromkeys(keys)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(out, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return out


class SavedState(dict):
    """Stands for a part of a sharded checkpoint that is read straight into the engine's shards.

    An optimizer's holds its ``param_groups`` (parameters by name: what an ``on_load_checkpoint`` hook may
    read); its per-parameter tensors stay on disk until the strategy loads them into the pieces.
    """

    def __init__(self, layout: Layout, index: Optional[int] = None) -> None:
        super().__init__({} if index is None else {"param_groups": layout.param_groups(index)})
        self.layout, self.index, self.path = layout, index, layout.path

    def __repr__(self) -> str:
        what = "model" if self.index is None else f"optimizer {self.index}"
        return f"SavedState({what} in {self.path})"


# ---- load --------------------------------------------------------------------------------------------
def read(path: Any, comm: Optional[Comm] = None) -> dict[str, Any]:
    """The checkpoint dict Lightning restores from: meta.pt's content, with the tensors still on disk.
    With ``comm`` every rank of it must call this (they share the checksum work); without, this process
    checks every file."""
    path = Path(path)
    verify_checksums(path, comm)
    metadata = check_complete(path)
    meta = load_meta(path)
    fmt = meta.get("lightning_zero", {}).get("format")
    layout = Layout(path, meta, metadata)
    if fmt not in (FORMAT, FORMAT_V1) and not layout.model_keys():
        raise CheckpointPathError(f"{path} is not a sharded checkpoint lightning_zero reads (its meta.pt has no "
                                  f"'{FORMAT}' marker and it holds no 'state_dict.*' tensors); load it with the tool "
                                  f"that wrote it.")
    checkpoint = {k: v for k, v in meta.items() if k not in ("optimizer_states", "state_dict_extra")}
    checkpoint["state_dict"] = SavedState(layout)
    if "current_model_state" in layout.lz.get("model_states", ()):
        # WeightAveraging's on_load_checkpoint reads both as plain mappings on every rank: whole tensors here (the
        # averaged copy it keeps is whole on every rank too); its load_state_dict writes into the masters
        checkpoint["state_dict"] = read_whole(layout, "state_dict", comm)
        checkpoint["current_model_state"] = read_whole(layout, "current_model_state", comm)
    count = layout.optimizer_count()
    if count:
        checkpoint["optimizer_states"] = [SavedState(layout, i) for i in range(count)]
    return checkpoint


def read_whole(layout: Layout, top: str, comm: Optional[Comm] = None) -> dict[str, Any]:
    """The state dict saved under ``top`` as whole tensors (and extra state) in this rank's memory."""
    found = layout.keys_under(top)
    targets = {key: torch.empty(layout.entries[key].size, dtype=layout.entries[key].properties.dtype)
               for key in found.values() if layout.is_tensor(key)}
    _load(targets, layout.path, comm)
    objects = read_objects(layout.path, sorted({key for key in found.values() if not layout.is_tensor(key)}))
    return {name: targets[key] if key in targets else objects[key] for name, key in found.items()}


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


def extras_of(layout: Layout, keys: dict[str, str]) -> dict[str, Any]:
    """Non-tensor entries of the state dict (``get_extra_state``)."""
    if layout.v1:
        return dict(layout.meta.get("state_dict_extra", {}))
    wanted = {name: key for name, key in keys.items() if key and not layout.is_tensor(key)}
    values = read_objects(layout.path, sorted(set(wanted.values())))
    return {name: values[key] for name, key in wanted.items()}


@torch.no_grad()
def load_into_module(saved: SavedState, module: nn.Module) -> dict[str, Any]:
    """Before setup: read the saved weights into the module's own tensors (in place, no copy of the model)
    and return them as the checkpoint's state dict (what a module's ``on_load_checkpoint`` sees)."""
    layout = saved.layout
    own = module.state_dict(keep_vars=True)
    targets, out = {}, {}
    keys = layout.model_keys()
    for name, key in keys.items():
        if key in targets or not layout.is_tensor(key):
            continue
        md = layout.entries[key]
        mine = own.get(name)
        if (isinstance(mine, torch.Tensor) and mine.numel() == md.size.numel() and mine.is_contiguous()
                and mine.device.type != "meta"):
            targets[key] = mine.detach().view(md.size)
        else:
            targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
    _load(targets, layout.path)
    for name, key in keys.items():
        if key in targets:
            out[name] = targets[key].view(layout.shape(key, name))
    out.update(extras_of(layout, keys))
    return out


def _shape_error(layout: Layout, name: str, saved: Any, mine: Any) -> CheckpointPathError:
    return CheckpointPathError(f"Checkpoint {layout.path} does not match the model: '{name}' has shape "
                               f"{tuple(saved)} there and {tuple(mine)} here. Resume from a checkpoint of this model.")


@torch.no_grad()
def load_into_engine(saved: SavedState, engine: ZeroEngine, strict: bool = True) -> None:
    """After setup: every rank reads only its own pieces into its fp32 masters (any saving world size)."""
    layout = saved.layout
    module = engine.module
    with allow_state_dict():
        plain = module.state_dict(keep_vars=True)
    have = layout.model_keys()
    if strict:
        check_keys(set(plain.keys()), have.keys(), layout.path)
    keys = keys_of(module)
    targets: dict[str, Any] = {}
    managed = set()
    for unit in engine.units:
        for slot, param in enumerate(unit.params):
            managed.add(id(param))
            name = next((k for k in keys[id(param)] if have.get(k)), None)
            numel = unit.layout.slots[slot].numel
            if name is None or not numel:
                continue
            key = have[name]
            size = layout.entries[key].size
            if size.numel() != numel or (not layout.v1 and size != torch.Size(unit.shapes[slot])):
                raise _shape_error(layout, name, size, unit.shapes[slot])
            piece = unit.spans[slot]
            targets[key] = PieceTensor(piece_values(unit, slot), size, piece.param_start if piece else 0,
                                       torch.float32)
    for name, value in plain.items():
        key = have.get(name)
        if key and isinstance(value, torch.Tensor) and id(value) not in managed and key not in targets \
                and layout.is_tensor(key):
            size = layout.entries[key].size
            if size.numel() != value.numel():
                raise _shape_error(layout, name, size, value.shape)
            targets[key] = value.detach().view(size)
    _load(targets, layout.path, engine.comm)
    engine.republish()


@torch.no_grad()
def load_optimizer(saved: SavedState, engine: ZeroEngine, optimizer: Any) -> None:
    """Read optimizer ``saved.index``'s state into this rank's pieces (any saving world size, stage or FSDP2)."""
    optimizer = unwrap(optimizer)
    layout, index = saved.layout, saved.index
    check_same_optimizer(layout.optimizer_class(index), optimizer, layout.path)
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"Checkpoint {layout.path} has {len(groups)} param groups for optimizer {index}, the "
                         f"optimizer has {len(optimizer.param_groups)}: configure_optimizers must build the same groups.")
    entries = layout.optimizer_entries(index)
    slots = engine.slots_of(optimizer)
    saved_names = {n for g in groups for n in g["params"]}
    lacking = [unit.names[s] for unit, s in slots if unit.names[s] not in saved_names]
    if lacking:
        raise ValueError(f"Checkpoint {layout.path} has no optimizer state for {lacking[:5]}: it was written for "
                         f"another model or other parameter groups.")
    for group, saved_group in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    targets: dict[str, Any] = {}
    scalars: dict[int, list[tuple[str, Any]]] = {}  # id(piece) -> (state key, DCP key or value)
    new_state: dict[Any, dict[str, Any]] = {}
    for unit, slot in slots:
        name, piece, span = unit.names[slot], unit.pieces[slot], unit.spans[slot]
        for key, (kind, where) in entries.get(name, {}).items():
            if kind == "scalar":
                if piece is not None:
                    if isinstance(where, str):
                        md = layout.entries[where]
                        targets.setdefault(where, torch.empty(md.size, dtype=md.properties.dtype)
                                           if layout.is_tensor(where) else None)
                    scalars.setdefault(id(piece), []).append((key, where))
                continue
            if where not in layout.entries:
                raise CheckpointPathError(f"Checkpoint {layout.path} is incomplete: no '{where}'. Resume from an "
                                          f"earlier checkpoint.")
            md = layout.entries[where]
            if md.size.numel() != unit.layout.slots[slot].numel:
                raise _shape_error(layout, f"{name}.{key}", md.size, unit.shapes[slot])
            dtype = md.properties.dtype
            local = torch.empty(piece.numel(), dtype=dtype, device=piece.device) if piece is not None else None
            targets[where] = PieceTensor(local, md.size, span.param_start if span else 0, dtype)
            if local is not None:
                new_state.setdefault(piece, {})[key] = local
    objects = {k: v for k, v in targets.items() if v is None}
    tensors = {k: v for k, v in targets.items() if v is not None}
    _load(tensors, layout.path, engine.comm)
    objects = read_objects(layout.path, list(objects))
    for unit, slot in slots:
        piece = unit.pieces[slot]
        if piece is None:
            continue
        entry = new_state.get(piece, {})
        group = group_of[id(unit.params[slot])]
        for key, where in scalars.get(id(piece), []):
            value = where if not isinstance(where, str) else tensors.get(where, objects.get(where))
            if key == "step" and isinstance(value, torch.Tensor) and (group.get("fused") or group.get("capturable")):
                entry[key] = value.to(device=piece.device, dtype=torch.float32)  # fused kernels want it there
            else:
                entry[key] = cpu_copy(value)
        if entry:
            optimizer.state[piece] = entry
        else:  # as torch's load_state_dict: a parameter without saved state starts fresh (a checkpoint written
            optimizer.state.pop(piece, None)  # before its first step, restored after steps: LearningRateFinder)


def _load(targets: dict[str, Any], path: Path, comm: Optional[Comm] = None) -> None:
    """Read ``targets`` from ``path``: over the engine's group, or (before setup, no engine yet) the default one."""
    reader = dcp.FileSystemReader(str(path))
    try:
        if comm is not None:
            comm.dcp_load(targets, reader)
        else:
            dcp.load(targets, storage_reader=reader)
    except Exception as err:  # DCP wraps each rank's failure; name the checkpoint and the way out
        raise CheckpointPathError(f"Reading checkpoint {path} failed: {str(err).splitlines()[0]}. If it was copied "
                                  f"or is still being written, copy the whole directory again.") from err
