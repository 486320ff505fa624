"""``lightning_zero.comm``: the calls DeepSpeed scripts make through ``deepspeed.comm``, on ``torch.distributed``.

Each works before a process group exists too (as one rank), so a script started as a plain process runs.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.distributed import ReduceOp

from .api import init_distributed

__all__ = ["init_distributed", "is_initialized", "get_rank", "get_world_size", "get_local_rank", "barrier",
           "all_reduce", "broadcast", "all_gather", "ReduceOp"]


def is_initialized() -> bool:
    return dist.is_initialized()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def barrier(group: Any = None) -> None:
    if dist.is_initialized():
        dist.barrier(group)


def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op) if dist.is_initialized() else None


def broadcast(tensor: Any, src: int, group: Any = None, async_op: bool = False) -> Any:
    return dist.broadcast(tensor, src, group=group, async_op=async_op) if dist.is_initialized() else None


def all_gather(tensor_list: list, tensor: Any, group: Any = None, async_op: bool = False) -> Any:
    if dist.is_initialized():
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)
    return None
