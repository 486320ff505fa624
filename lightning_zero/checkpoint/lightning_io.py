"""The strategy's checkpoint hooks: what goes into a Lightning checkpoint and how it comes back.

Two formats (``ZeroConfig.checkpoint_format``): ``sharded``, a directory in which every rank
writes and reads only its own pieces (:mod:`lightning_zero.checkpoint.sharded`), and ``full``,
one ordinary Lightning file gathered on rank 0 (:mod:`lightning_zero.engine.state`). Lightning's
own file handling is passed in (``save_file`` / ``load_file`` / ``load_plain``) where a
checkpoint is not ours to read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..collectives import Comm
from ..engine import ZeroEngine
from ..engine.state import (
    check_keys,
    check_shapes,
    full_model_state,
    full_optimizer_state,
    load_model_state,
    load_optimizer_state,
)
from . import deepspeed_format, dtensors, sharded
from .files import META_FILE, CheckpointPathError

__all__ = ["module_state", "module_state_is_local", "optimizer_state", "save", "load", "load_model", "load_optimizers"]


def module_state(engine: ZeroEngine, sharded_format: bool, keep: bool, in_place: bool = False) -> dict[str, Any]:
    """The module's state for a checkpoint: DTensors (sharded; ``in_place``: this rank's pieces themselves,
    no collective, for a save nobody else looks at) or the full fp32 state dict (ranks without ``keep`` get
    ``{}``)."""
    if sharded_format:
        return sharded.model_pieces(engine) if in_place else dtensors.model_state(engine)
    return full_model_state(engine, keep=keep)


def module_state_is_local(engine: ZeroEngine, sharded_format: bool) -> bool:
    """Whether :func:`module_state` runs without a collective (see ``dtensors.model_state_is_local``)."""
    return sharded_format and dtensors.model_state_is_local(engine)


def optimizer_state(engine: ZeroEngine, optimizer: Any, sharded_format: bool, keep: bool,
                    in_place: bool = False) -> dict[str, Any]:
    """An optimizer's state for a checkpoint (a collective either way; ``in_place`` as in :func:`module_state`)."""
    if sharded_format:
        return sharded.optimizer_pieces(engine, optimizer) if in_place else dtensors.optimizer_state(engine, optimizer)
    return full_optimizer_state(engine, optimizer, keep=keep)


def save(checkpoint: dict[str, Any], filepath: Any, engine: Optional[ZeroEngine], comm: Comm, sharded_format: bool,
         storage_options: Optional[Any], save_file: Callable[..., None]) -> None:
    """Sharded: every rank writes its part of directory ``filepath`` (atomically, see ``checkpoint.files``).
    Full: ``save_file`` (Lightning's CheckpointIO, rank 0) writes one file."""
    if sharded_format:
        if storage_options is not None:
            raise TypeError("ZeroStrategy's sharded checkpoints take no storage_options; use "
                            "checkpoint_format='full' to save through a CheckpointIO plugin.")
        sharded.save(checkpoint, filepath, comm, sharded.describe_model(engine))
        return
    if Path(filepath).is_dir():
        raise CheckpointPathError(f"Cannot write a one-file checkpoint to {filepath}: it is a directory (a sharded "
                                  f"checkpoint?). Choose another path, or keep checkpoint_format='sharded'.")
    save_file(checkpoint, filepath, storage_options=storage_options)


def load(checkpoint_path: Any, engine: Optional[ZeroEngine], module: nn.Module, plain_io: bool,
         load_file: Callable[[], dict[str, Any]], weights_only: Optional[bool], comm: Optional[Comm] = None
         ) -> dict[str, Any]:
    """A sharded directory (any world size and stage wrote it), a DeepSpeed checkpoint directory (DeepSpeed's
    engine or Lightning's ``DeepSpeedStrategy`` wrote it), or a one-file checkpoint (read with ``mmap``: no
    rank copies the whole file into memory; ``load_file`` for a custom CheckpointIO)."""
    path = Path(checkpoint_path)
    if path.is_dir() and not (path / META_FILE).exists() and deepspeed_format.is_deepspeed_checkpoint(path):
        checkpoint = deepspeed_format.lightning_checkpoint(path, module)
    elif path.is_dir() or not path.exists():
        checkpoint = sharded.read(path, comm)  # names the missing / incomplete / foreign / damaged directory
        if engine is None and isinstance(checkpoint["state_dict"], sharded.SavedState):  # before setup: in place
            checkpoint["state_dict"] = sharded.load_into_module(checkpoint["state_dict"], module)
    elif not plain_io:
        checkpoint = load_file()
    else:
        torch.cuda.empty_cache()
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=bool(weights_only))
    checkpoint["_path"] = str(path)  # for error messages; Lightning ignores unknown keys
    return checkpoint


def load_model(checkpoint: Mapping[str, Any], engine: Optional[ZeroEngine], module: nn.Module, strict: bool,
               load_plain: Callable[[], None]) -> None:
    """Weights into the engine's shards, or (before setup) into the module through ``load_plain``."""
    saved = checkpoint["state_dict"]
    ready = engine is not None and bool(engine.units)
    if isinstance(saved, sharded.SavedState):
        if not ready:
            raise RuntimeError("A sharded checkpoint's weights load into a set-up engine; this is a bug.")
        sharded.load_into_engine(saved, engine, strict=strict)
    elif not ready:
        own = module.state_dict()
        if strict:
            check_keys(own.keys(), saved.keys(), checkpoint.get("_path"))
        check_shapes({k: v.shape for k, v in own.items()}, saved, checkpoint.get("_path"))
        load_plain()
    else:
        load_model_state(engine, saved, strict=strict)


def load_optimizers(engine: ZeroEngine, optimizers: list[Any], states: list[Any]) -> None:
    for optimizer, state in zip(optimizers, states):
        if isinstance(state, sharded.SavedState):
            sharded.load_optimizer(state, engine, optimizer)
        else:
            load_optimizer_state(engine, optimizer, state)
