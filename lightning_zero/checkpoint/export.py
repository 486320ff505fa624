"""Export a sharded checkpoint directory as one ordinary Lightning checkpoint, or a plain state dict.

Runs in one process without a process group. Every tensor is read from the directory when
the writer reaches it (:mod:`.stream`), so memory stays about the size of the largest tensor.
The optimizer state comes out in torch's own format with the parameter names beside it, the
same as ``checkpoint_format="full"`` writes: DDP, a plain optimizer or any stage loads it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ..engine.state import FORMAT as FULL_FORMAT
from .files import META_FILE, CheckpointPathError, check_complete
from .sharded import FORMAT, FORMAT_V1, Layout, extras_of, load_meta, read_objects, verify_checksums
from .stream import LazyTensor, materialize, save_streaming

__all__ = ["consolidated", "write_checkpoint", "write_weights", "read_directory"]


class _Reader:
    def __init__(self, path: Path, metadata: Any) -> None:
        self.path, self.metadata = path, metadata

    def lazy(self, key: str, shape: Any) -> LazyTensor:
        md = self.metadata.state_dict_metadata[key]
        return LazyTensor(shape, md.properties.dtype, lambda: self._read(key).view(shape))

    def _read(self, key: str) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[key]
        out = torch.empty(md.size, dtype=md.properties.dtype)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load({key: out}, storage_reader=dcp.FileSystemReader(str(self.path)), no_dist=True)
        return out


def consolidated(path: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(checkpoint, state_dict): the Lightning checkpoint with lazy tensors, and its model state dict.
    Reads our directories (both formats) and those of Lightning's FSDP2 strategy."""
    path = Path(path)
    verify_checksums(path)  # one process: every file
    metadata = check_complete(path)
    meta = load_meta(path)
    layout = Layout(path, meta, metadata)
    keys = layout.model_keys()
    if meta.get("lightning_zero", {}).get("format") not in (FORMAT, FORMAT_V1) and not keys:
        raise CheckpointPathError(f"{path} is not a sharded checkpoint lightning_zero reads (no '{FORMAT}' in "
                                  f"meta.pt and no 'state_dict.*' tensors).")
    reader = _Reader(path, metadata)
    lazy: dict[str, LazyTensor] = {}
    state_dict: dict[str, Any] = {}
    for name, key in keys.items():
        if key and layout.is_tensor(key):
            state_dict[name] = lazy.setdefault(key, reader.lazy(key, layout.shape(key, name)))
    state_dict.update(extras_of(layout, keys))
    checkpoint = {k: v for k, v in meta.items() if k not in ("lightning_zero", "state_dict_extra", "optimizer_states")}
    checkpoint["state_dict"] = state_dict
    if "current_model_state" in layout.lz.get("model_states", ()):  # WeightAveraging's (see sharded.MODEL_STATES)
        current = layout.keys_under("current_model_state")
        checkpoint["current_model_state"] = {
            name: lazy.setdefault(key, reader.lazy(key, layout.shape(key, name)))
            for name, key in current.items() if layout.is_tensor(key)}
        objects = read_objects(layout.path, sorted({k for k in current.values() if not layout.is_tensor(k)}))
        checkpoint["current_model_state"].update({name: objects[k] for name, k in current.items() if k in objects})
    count = layout.optimizer_count()
    if count:
        checkpoint["optimizer_states"] = [_optimizer(reader, layout, i, state_dict) for i in range(count)]
    return checkpoint, state_dict


def _optimizer(reader: _Reader, layout: Layout, index: int, weights: dict[str, Any]) -> dict[str, Any]:
    """torch's optimizer format: state by position in the param groups, per-element tensors full-shaped."""
    groups = layout.param_groups(index)
    entries = layout.optimizer_entries(index)
    names, out_groups = [], []
    for group in groups:
        start = len(names)
        names += list(group["params"])
        out_groups.append({**group, "params": list(range(start, len(names)))})
    tensor_scalars = [w for e in entries.values() for kind, w in e.values()
                      if kind == "scalar" and isinstance(w, str) and not layout.is_tensor(w)]
    objects = read_objects(layout.path, tensor_scalars)
    state: dict[int, dict[str, Any]] = {}
    elementwise: set[str] = set()
    for position, name in enumerate(names):
        entry: dict[str, Any] = {}
        for key, (kind, where) in entries.get(name, {}).items():
            if kind == "part":
                entry[key] = reader.lazy(where, weights[name].shape)
                elementwise.add(key)
            elif isinstance(where, str):
                entry[key] = reader._read(where) if layout.is_tensor(where) else objects[where]
            else:
                entry[key] = where
        if entry:
            state[position] = entry
    return {"state": state, "param_groups": out_groups,
            "lightning_zero": {"format": FULL_FORMAT, "param_names": names, "elementwise": sorted(elementwise),
                               "optimizer": layout.optimizer_class(index)}}


def _target(out: Any) -> Path:
    out = Path(out)
    if out.is_dir():
        raise CheckpointPathError(f"Cannot write {out}: it is a directory. Give a file name (e.g. {out}/model.ckpt).")
    if not out.parent.exists():
        raise CheckpointPathError(f"Cannot write {out}: directory {out.parent} does not exist. Create it first.")
    return out


def write_checkpoint(src: Any, out: Any) -> int:
    """One Lightning checkpoint file (what ``checkpoint_format="full"`` writes); returns tensor bytes."""
    out = _target(out)
    checkpoint, _ = consolidated(src)
    return save_streaming(checkpoint, out)


def write_weights(src: Any, out: Any) -> int:
    """A plain ``state_dict`` (the module's keys, fp32) that ``module.load_state_dict`` takes."""
    out = _target(out)
    _, state_dict = consolidated(src)
    return save_streaming(state_dict, out)


def read_directory(path: Any, map_location: Any = None) -> dict[str, Any]:
    """A checkpoint directory as one in-memory Lightning checkpoint (``LightningModule.load_from_checkpoint``):
    ours, read tensor by tensor, or DeepSpeed's (its weights and whatever Lightning state it holds)."""
    from . import deepspeed_format

    path = Path(path)
    if not (path / META_FILE).exists() and deepspeed_format.is_deepspeed_checkpoint(path):
        ckpt = deepspeed_format.DeepSpeedCheckpoint(path)
        checkpoint = dict(ckpt.client_state)
        checkpoint["state_dict"] = ckpt.weights()
    else:
        checkpoint, _ = consolidated(path)
        checkpoint.pop("optimizer_states", None)  # weights, hyper-parameters and hooks' state only
        checkpoint["state_dict"] = materialize(checkpoint["state_dict"])
    if map_location is not None and not callable(map_location) and not isinstance(map_location, dict):
        checkpoint["state_dict"] = {k: v.to(map_location) if isinstance(v, torch.Tensor) else v
                                    for k, v in checkpoint["state_dict"].items()}
    return checkpoint
