"""FlatUnit: the buffers and state of one sharded unit of parameters.

[Note: buffers of a unit]
- ``full``   1D, padded, compute dtype: every rank's parameters side by side. Module
  parameters' ``.data`` are views into it while the unit is UNSHARDED.
- ``shard``  1D, this rank's chunk of ``full`` in compute dtype. Stages 1/2 keep ``full``
  alive, so ``shard`` is a view of it. Stage 3 frees ``full`` between uses and keeps no
  16-bit shard at all: each gather casts the fp32 master on the fly (``gather_source``), so
  its model state is the fp32 master, gradient and optimizer shards alone (16Ψ/N for Adam).
- ``master`` 1D fp32 chunk, the tensor the user's optimizer steps. It *is* ``shard`` when the
  compute dtype is fp32 (no copy), otherwise a separate fp32 tensor. Its ``.grad`` (fp32)
  is the rank's gradient shard, so ``optimizer.zero_grad()`` keeps its usual meaning.
- ``grad_full`` 1D, padded, reduce dtype: gradients are copied in by post-accumulate-grad
  hooks and reduce-scattered from it. Transient per micro-batch in stage 2/3, persistent
  across the accumulation window in stage 1.

[Note: sharded parameters]
While a stage-3 unit is SHARDED its parameters' ``.data`` is an empty tensor: a use outside
the gathered window fails loudly with a size error instead of reading freed memory.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..partition import UnitLayout

__all__ = ["UnitState", "FlatUnit"]


class UnitState(enum.Enum):
    UNSHARDED = "unsharded"  # parameters are views into ``full``
    SHARDED = "sharded"  # only ``shard`` exists; parameters are empty


@dataclass(eq=False)
class FlatUnit:
    """One unit of parameters laid out by :func:`lightning_zero.partition.layout_unit`.

    Args:
        index: position in the engine's launch order (the same on every rank).
        params: the unit's parameters, in layout order.
        names: their fully qualified names in the module.
        layout: slots and the even split across ranks.
        rank: this rank's index in the sharding group.
        compute_dtype: dtype of the module's parameters and gradients.
        reduce_dtype: dtype of the gradient buffer and of its reduce-scatter.
        group_index: (optimizer index, param group index) owning the unit.
    """

    index: int
    params: list[nn.Parameter]
    names: list[str]
    layout: UnitLayout
    rank: int
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    group_index: tuple[int, int] = (-1, -1)  # (optimizer, param group); (-1, -1): no optimizer
    shapes: list[torch.Size] = field(default_factory=list)
    state: UnitState = UnitState.UNSHARDED
    full: Optional[torch.Tensor] = None
    shard: Optional[torch.Tensor] = None
    master: Optional[nn.Parameter] = None
    grad_full: Optional[torch.Tensor] = None
    grad_written: set = field(default_factory=set)  # slot indices holding a gradient this window
    pending: int = 0  # trainable parameters whose gradient has not arrived this backward
    pins: int = 0  # stage 3: running scopes (forward of a group module, a pinned step) using the unit

    @property
    def accepts_grads(self) -> bool:
        # LightningModule.toggle_optimizer flips requires_grad on the optimizer's tensors, which
        # are the masters: a master switched off means "drop this unit's gradients".
        return self.master is None or self.master.requires_grad

    @property
    def trainable(self) -> list[int]:
        if not self.accepts_grads:
            return []
        return [i for i, p in enumerate(self.params) if p.requires_grad]

    @property
    def shard_slice(self) -> slice:
        lo, hi = self.layout.shard_range(self.rank)
        return slice(lo, hi)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a full-size flat tensor of this unit."""
        return [flat[s.offset:s.end].view(shape) for s, shape in zip(self.layout.slots, self.shapes)]

    # ---- construction -------------------------------------------------------------
    def build_from_flat(self, staging: torch.Tensor, keep_full: bool) -> None:
        """Take an fp32 full-size flat tensor (identical on all ranks) as the unit's values."""
        chunk = staging[self.shard_slice]
        if keep_full:
            self.full = staging if self.compute_dtype == torch.float32 else staging.to(self.compute_dtype)
            self.shard = self.full[self.shard_slice]
        else:
            self.full = None
            self.shard = chunk.clone() if self.compute_dtype == torch.float32 else None
        master_data = self.shard if self.shard is not None and self.compute_dtype == torch.float32 else chunk.clone()
        self.master = nn.Parameter(master_data, requires_grad=True)
        if keep_full:
            self.point_params_at_full()
        else:
            self.empty_params()

    # ---- state transitions ----------------------------------------------------------
    def point_params_at_full(self) -> None:
        assert self.full is not None
        for param, view in zip(self.params, self.views(self.full)):
            param.data = view
        self.state = UnitState.UNSHARDED

    def empty_params(self) -> None:
        for param in self.params:
            param.data = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        self.state = UnitState.SHARDED

    def sync_shard_from_master(self) -> None:
        """After an optimizer step: the compute-dtype shard takes the new fp32 values."""
        if self.shard is not None and self.master.data_ptr() != self.shard.data_ptr():
            self.shard.copy_(self.master.detach())

    @property
    def device(self) -> torch.device:
        return self.master.device

    @property
    def master_is_shard(self) -> bool:
        return self.shard is not None and self.master.data_ptr() == self.shard.data_ptr()

    def gather_source(self) -> torch.Tensor:
        """This rank's chunk in compute dtype, as all-gather input (cast from the master if needed)."""
        if self.shard is not None:
            return self.shard
        return self.master.detach().to(self.compute_dtype)

    # ---- gradients --------------------------------------------------------------------
    def new_grad_buffer(self) -> torch.Tensor:
        return torch.zeros(self.layout.padded_numel, dtype=self.reduce_dtype, device=self.device)

    def add_grad(self, slot_index: int, grad: torch.Tensor) -> None:
        """Copy (first micro-batch of the window) or add one parameter's gradient."""
        if self.grad_full is None:
            self.grad_full = self.new_grad_buffer()
        slot = self.layout.slots[slot_index]
        target = self.grad_full[slot.offset:slot.end]
        if slot_index in self.grad_written:
            target.add_(grad.reshape(-1))
        else:
            target.copy_(grad.reshape(-1))
            self.grad_written.add(slot_index)
