"""``lightning_zero.checkpointing``: DeepSpeed's activation-checkpointing calls (``deepspeed.checkpointing``) for
scripts that use them, on torch's non-reentrant checkpoint (which stage 3's gathers and the reducer's hooks see
as ordinary recomputation). DeepSpeed's activation partitioning and CPU checkpointing shard activations across
model-parallel ranks; there are none here, so asking for them is refused rather than silently ignored."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch.utils.checkpoint

__all__ = ["checkpoint", "non_reentrant_checkpoint", "configure", "is_configured", "reset"]

_configured = [False]


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    if mpu_ is not None:
        raise ValueError("checkpointing.configure(mpu_=...): lightning_zero has no model parallelism; pass mpu_=None.")
    wanted = [name for name, on in (("partition_activations", partition_activations),
                                    ("contiguous_checkpointing", contiguous_checkpointing),
                                    ("checkpoint_in_cpu", checkpoint_in_cpu)) if on]
    if wanted:
        raise ValueError(f"checkpointing.configure({', '.join(f'{w}=True' for w in wanted)}): these split "
                         f"activations across model-parallel ranks or move them to the CPU, which lightning_zero "
                         f"does not do; leave them off (checkpointing itself still recomputes activations).")
    _configured[0] = True


def is_configured() -> bool:
    return _configured[0]


def reset() -> None:
    """DeepSpeed frees its checkpoint buffers here; torch's checkpoint keeps none."""


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` whose activations are recomputed in backward instead of kept."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


non_reentrant_checkpoint = checkpoint
