"""Full fp32 weights out of a ZeRO checkpoint, ours or DeepSpeed's, with DeepSpeed's function names.

``CHECKPOINT_DIR`` is what ``engine.save_checkpoint(save_dir)`` was given (its ``latest`` file names the
tag, or pass ``tag``), a tag directory itself, a ``ZeroStrategy`` sharded checkpoint, or a directory that
DeepSpeed or Lightning's ``DeepSpeedStrategy`` wrote. One process, no process group, no GPU.

    lightning-zero-to-fp32 CHECKPOINT_DIR OUTPUT [--tag TAG] [--exclude_frozen_parameters]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Union

from torch import nn

from ..checkpoint import deepspeed_format
from ..checkpoint.export import consolidated
from ..checkpoint.files import META_FILE, CheckpointPathError
from ..checkpoint.stream import materialize, save_streaming

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint", "main"]

PathLike = Union[str, Path]


def _resolve(checkpoint_dir: PathLike, tag: Optional[str]) -> Path:
    path = Path(checkpoint_dir)
    if not path.exists():
        raise CheckpointPathError(f"Checkpoint directory {path} does not exist.")
    if tag is not None:
        path = path / str(tag)
        if not path.is_dir():
            raise CheckpointPathError(f"Checkpoint tag directory {path} does not exist.")
        return path
    if (path / META_FILE).exists() or deepspeed_format.find_tag_dir(path) == path:
        return path
    latest = path / "latest"
    if latest.is_file():
        return path / latest.read_text().strip()
    if deepspeed_format.is_deepspeed_checkpoint(path):
        return path
    raise CheckpointPathError(f"{path} is not a ZeRO checkpoint: no {META_FILE} (lightning_zero), no DeepSpeed "
                              f"model states, and no 'latest' file naming a tag. Pass tag=... or the tag directory.")


def _lazy_state(checkpoint_dir: PathLike, tag: Optional[str], exclude_frozen_parameters: bool) -> dict[str, Any]:
    path = _resolve(checkpoint_dir, tag)
    if deepspeed_format.is_deepspeed_checkpoint(path):
        return deepspeed_format.DeepSpeedCheckpoint(path).weights(exclude_frozen=exclude_frozen_parameters)
    _, state = consolidated(path)
    return state


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: PathLike, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, Any]:
    """The model's ``state_dict`` with fp32 parameters (buffers in their dtype), on the CPU.

    ``lazy_mode=True`` returns lightning_zero checkpoints' tensors as placeholders whose ``load()`` reads
    them, so a model bigger than host memory can be walked tensor by tensor. ``exclude_frozen_parameters``
    applies to DeepSpeed's checkpoints (they record which parameters were frozen)."""
    state = _lazy_state(checkpoint_dir, tag, exclude_frozen_parameters)
    if lazy_mode:
        return state
    return materialize(state)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: PathLike, output_dir_or_file: PathLike,
                                               tag: Optional[str] = None, exclude_frozen_parameters: bool = False,
                                               safe_serialization: bool = False, max_shard_size: Any = None) -> Path:
    """Write the fp32 ``state_dict`` as one ``torch.save`` file (an existing directory gets
    ``pytorch_model.bin`` in it), one tensor in memory at a time for lightning_zero checkpoints."""
    if safe_serialization:
        raise ValueError("safe_serialization=True is not supported: this writes torch.save files. Load the result "
                         "with torch.load and save it with safetensors if you need that format.")
    out = Path(output_dir_or_file)
    if out.is_dir() or str(output_dir_or_file).endswith(("/", "\\")):
        out.mkdir(parents=True, exist_ok=True)
        out = out / "pytorch_model.bin"
    if not out.parent.exists():
        raise CheckpointPathError(f"Cannot write {out}: directory {out.parent} does not exist. Create it first.")
    state = _lazy_state(checkpoint_dir, tag, exclude_frozen_parameters)
    save_streaming(state, out)
    return out


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: PathLike,
                                         tag: Optional[str] = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into a plain (not ZeRO-wrapped) ``model`` on the CPU and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    keys = model.state_dict().keys()
    rename = deepspeed_format.align_names(state, keys)
    model.load_state_dict({rename[k]: v for k, v in state.items()}, strict=True)
    return model


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-zero-to-fp32", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="save_dir of engine.save_checkpoint, a tag directory, a ZeroStrategy "
                                               "sharded checkpoint, or a DeepSpeed checkpoint directory")
    parser.add_argument("output_dir_or_file", help="output file (an existing directory gets pytorch_model.bin)")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    args = parser.parse_args(argv)
    try:
        out = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir_or_file, args.tag,
                                                         args.exclude_frozen_parameters)
    except (CheckpointPathError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
