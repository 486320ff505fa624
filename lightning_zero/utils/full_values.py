"""DeepSpeed's ``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_grad`` / ``safe_get_full_optimizer_state``
/ ``safe_set_full_fp32_param`` and their ``safe_get_local_*`` forms, for parameters an engine shards.

The full forms are collectives: every rank calls them for the same parameter and gets the whole tensor (shape of
the parameter, fp32). The local forms return this rank's piece, flat (None where this rank holds none of it). A
parameter no engine manages answers from itself (its ``.data``, ``.grad``, and no optimizer state). Gradients exist
from a backward until the optimizer step (or ``zero_grad``) frees them, as in DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_get_local_fp32_param", "safe_get_local_grad",
           "safe_get_local_optimizer_state"]


def _engine(param: nn.Parameter) -> Any:
    from ..engine import ZeroEngine

    engine = ZeroEngine.owning(param)
    if engine is not None and engine.config.offload_optimizer == "nvme":
        raise ValueError("safe_get_*/safe_set_* read the fp32 master and optimizer state in memory; with "
                         "offload_optimizer='nvme' they live in files: read a checkpoint instead "
                         "(lightning_zero.utils.zero_to_fp32).")
    return engine


def _local(engine: Any, param: nn.Parameter, read: Callable[[nn.Parameter], Optional[torch.Tensor]]
           ) -> Optional[torch.Tensor]:
    unit, slot = engine.slot_of(param)
    piece = unit.pieces[slot]
    return None if piece is None else read(piece)


@torch.no_grad()
def _full(engine: Any, param: nn.Parameter, read: Callable[[nn.Parameter], Optional[torch.Tensor]]
          ) -> Optional[torch.Tensor]:
    """Every rank's piece of ``read`` (None on every rank where no rank has it) gathered into the full tensor."""
    unit, slot = engine.slot_of(param)
    shard = torch.zeros(unit.layout.shard_numel, dtype=torch.float32, device=engine.device)
    piece, where = unit.pieces[slot], unit.spans[slot]
    value = read(piece) if piece is not None else None
    if value is not None:
        shard[where.shard_start:where.shard_start + where.length] = value.reshape(-1).to(shard)
    missing = torch.tensor([1.0 if piece is not None and value is None else 0.0], device=engine.device)
    engine.comm.all_reduce(missing, op="max")  # a rank lacking its piece's value: no value anywhere
    full = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=engine.device)
    engine.comm.all_gather(full, shard, async_op=False)
    if missing.item() > 0.0:
        return None
    return unit.param_views(full)[slot].clone()


def _grad(piece: nn.Parameter) -> Optional[torch.Tensor]:
    return piece.grad


def _state(engine: Any, key: str) -> Callable[[nn.Parameter], Optional[torch.Tensor]]:
    """A piece's per-element optimizer state ``key`` (``exp_avg``, ...) in whichever engine optimizer steps it."""
    def read(piece: nn.Parameter) -> Optional[torch.Tensor]:
        for optimizer in engine.optimizers:
            value = optimizer.state.get(piece, {}).get(key)
            if isinstance(value, torch.Tensor) and value.numel() == piece.numel():
                return value
        return None
    return read


def _read(param: nn.Parameter, what: str, key: str = "", full: bool = True) -> Optional[torch.Tensor]:
    """``what``: "param", "grad" or "state" (optimizer state ``key``); ``full``: gathered (a collective) or this
    rank's piece, flat."""
    engine = _engine(param)
    if engine is None:  # not sharded: the parameter answers itself (no optimizer state is known for it)
        value = {"param": param.detach(), "grad": param.grad, "state": None}[what]
        if value is None:
            return None
        value = value.detach().float()
        return value.clone() if full else value.reshape(-1)
    if what == "grad":
        engine.finish_grads()
    read = {"param": lambda piece: piece.data, "grad": _grad, "state": _state(engine, key)}[what]
    return _full(engine, param, read) if full else _local(engine, param, read)


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor:
    return _read(param, "param")


def safe_get_full_grad(param: nn.Parameter) -> Optional[torch.Tensor]:
    return _read(param, "grad")


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    return _read(param, "state", optim_state_key)


@torch.no_grad()
def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Every rank passes the same full ``value``: it becomes the fp32 master (and the module's values)."""
    if _engine(param) is None:
        param.copy_(value)
        return
    from ..zero import GatheredParameters

    with GatheredParameters([param], modifier_rank=0):
        param.data.copy_(value.to(param.dtype))


def safe_get_local_fp32_param(param: nn.Parameter) -> Optional[torch.Tensor]:
    return _read(param, "param", full=False)


def safe_get_local_grad(param: nn.Parameter) -> Optional[torch.Tensor]:
    return _read(param, "grad", full=False)


def safe_get_local_optimizer_state(param: nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    return _read(param, "state", optim_state_key, full=False)
