"""The on-disk protocol of a sharded checkpoint directory.

[Note: atomic directories]
Every rank writes into ``NAME.partial`` beside the final path. DCP writes its ``.metadata``
only after every rank has reported its files written; then rank 0 writes ``meta.pt`` (the
non-tensor training state) and renames the directory to ``NAME``. A directory named ``NAME``
is therefore complete; ``NAME.partial`` is a save that never finished (it is removed by the
next save to the same name). Replacing an existing ``NAME`` (``last.ckpt``) moves it to
``NAME.old`` first and deletes it after the rename, so a crash leaves either the old or the
new checkpoint under ``NAME`` (or, in the instant between the two renames, under ``NAME.old``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

__all__ = ["META_FILE", "DCP_METADATA", "CheckpointPathError", "partial_path", "prepare_partial", "commit",
           "check_complete", "is_sharded", "read_dcp_metadata"]

META_FILE = "meta.pt"
DCP_METADATA = ".metadata"


class CheckpointPathError(ValueError):
    """A checkpoint path that cannot be used; the message names the path and the fix."""


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def prepare_partial(path: Path) -> Path:
    """Rank 0: check ``path`` can become a checkpoint directory and create its empty ``.partial``."""
    if path.is_file():
        raise CheckpointPathError(
            f"Cannot write a sharded checkpoint to {path}: it is a file and sharded checkpoints are directories. "
            f"Choose another path, delete the file, or save a one-file checkpoint with checkpoint_format='full'.")
    partial = partial_path(path)
    try:
        if partial.exists():
            shutil.rmtree(partial)  # an earlier save that never finished
        partial.mkdir(parents=True)
    except OSError as err:
        raise CheckpointPathError(f"Cannot write a checkpoint to {path}: {err.strerror or err} ({partial}). "
                                  f"Choose a writable directory (ModelCheckpoint(dirpath=...) or default_root_dir).") from None
    return partial


def commit(path: Path) -> None:
    """Rank 0, after every rank wrote: move ``.partial`` into place (see [Note: atomic directories])."""
    partial, old = partial_path(path), path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        path.rename(old)
    _fsync_dir(partial)
    partial.rename(path)
    _fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_sharded(path: Any) -> bool:
    return Path(path).is_dir()


def read_dcp_metadata(path: Path) -> Any:
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # noqa: BLE001 - truncated/overwritten: torch says "Invalid argument" with no path
        raise CheckpointPathError(f"Checkpoint {path}: {DCP_METADATA} is damaged ({type(err).__name__}). Resume "
                                  f"from an earlier checkpoint or copy the whole directory again.") from None


def check_complete(path: Path) -> Any:
    """Raise a one-line error unless ``path`` is a whole sharded checkpoint; return DCP's metadata."""
    if not path.exists():
        partial = partial_path(path)
        extra = (f" {partial} exists: that save did not finish; resume from an earlier checkpoint."
                 if partial.exists() else " Check the path (ckpt_path=...).")
        raise CheckpointPathError(f"Checkpoint {path} does not exist.{extra}")
    if not path.is_dir():
        raise CheckpointPathError(f"{path} is a file, not a sharded checkpoint directory: pass the directory a "
                                  f"sharded save wrote, or load this file as a one-file checkpoint.")
    for name in (DCP_METADATA, META_FILE):
        if not (path / name).is_file():
            raise CheckpointPathError(
                f"Checkpoint {path} is incomplete: {name} is missing (a save that did not finish, or a copy that "
                f"lost files). Resume from an earlier checkpoint or copy the whole directory again.")
    metadata = read_dcp_metadata(path)
    sizes: dict[str, int] = {}
    for info in metadata.storage_data.values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(sizes.items()):
        file = path / name
        have = file.stat().st_size if file.is_file() else -1
        if have < size:
            what = "is missing" if have < 0 else f"is truncated ({have} of {size} bytes)"
            raise CheckpointPathError(f"Checkpoint {path} is incomplete: {name} {what}. Resume from an earlier "
                                      f"checkpoint or copy the whole directory again.")
    return metadata
