"""Offload: the optimizer side of chosen units lives in host memory (or files) and steps there.

[Note: what moves]
For an offloaded unit the fp32 master, its pieces (so the optimizer creates its state next to
them), and the reduced gradient shard live on the host; the device keeps what forward and
backward need: the compute-dtype parameters (stages 1/2: the full buffer; stage 3: a
compute-dtype shard to gather from, unless ``offload_params`` moves that too). Which units
move is :func:`lightning_zero.partition.plan_offload` of ``offload_fraction``, by bytes.

[Note: the pipeline]
- backward: each unit's reduce-scatter output is copied device→host on a side stream as soon
  as it is reduced, while backward goes on. Micro-batches before the last of an accumulation
  window add into a device accumulator instead, so the slow link is crossed once per step.
- step: the device part is stepped first (its kernels are queued and run on the GPU), then the
  host steps its units chunk by chunk; after each chunk its new values are queued for the
  device (pinned, asynchronous) and all-gathered, while the CPU already steps the next chunk.
Global clipping and the fp16 overflow vote need every gradient of the step, so the host step
starts once backward has ended.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch

from ..config import ZeroConfig
from ..partition import chunk_units, plan_offload
from .flat_unit import FlatUnit
from .host import HostArena
from .optim import pieces_in_groups
from .swap import ASSUMED_STATE_KEYS, NvmeStore, resolve_nvme_dir

__all__ = ["Offloader", "HOST_STEP_CHUNK"]

log = logging.getLogger(__name__)

HOST_STEP_CHUNK = 64_000_000  # elements per host optimizer call: large enough that its overhead vanishes
_FUSABLE = tuple(getattr(torch.optim, n) for n in ("Adam", "AdamW", "SGD", "Adagrad") if hasattr(torch.optim, n))


class Offloader:
    """Places, feeds and steps the offloaded units of one engine.

    Args:
        units: the engine's units (index = backward finishing order).
        config: offload fields of the ZeRO config.
        device: the compute device.
        compute_dtype: dtype of the module's parameters.
    """

    def __init__(self, units: Sequence[FlatUnit], config: ZeroConfig, device: torch.device,
                 compute_dtype: torch.dtype, rank: int = 0) -> None:
        self.config = config
        self.device = device
        self.compute_dtype = compute_dtype
        chosen = plan_offload([u.layout.shard_numel for u in units], config.offload_fraction)
        self.units = [units[i] for i in chosen]
        self.indices = {u.index for u in self.units}
        self._position = {u.index: i for i, u in enumerate(self.units)}
        self.cuda = device.type == "cuda"
        pin = config.pin_memory and self.cuda
        sizes = [u.layout.shard_numel for u in self.units]
        nvme_masters = config.offload_optimizer == "nvme"
        self.masters = HostArena([] if nvme_masters else sizes, torch.float32, pin)
        self.grads = HostArena(sizes, torch.float32, pin)
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._copies: list[Any] = []  # events of device->host gradient copies not yet waited for
        self._accum: dict[int, torch.Tensor] = {}  # device accumulators of the window's earlier micro-batches
        self.store: Optional[NvmeStore] = None
        nvme_params = config.shard_params and config.offload_params == "nvme"
        if nvme_masters or nvme_params:
            per_elem = (4 * (1 + ASSUMED_STATE_KEYS) if nvme_masters else 0) + (compute_dtype.itemsize if nvme_params else 0)
            root = resolve_nvme_dir(config.nvme_path, per_elem * self.offloaded_numel)
            self.store = NvmeStore(self.units, root, rank, config.nvme_buffer_bytes, pin, masters=nvme_masters,
                                   params_dtype=compute_dtype if nvme_params else None)
        if not nvme_masters:
            self._move_masters()
        if not nvme_params:
            self._place_param_shards(pin)

    @property
    def offloaded_numel(self) -> int:
        return sum(u.layout.shard_numel for u in self.units)

    def describe(self, total_numel: int) -> str:
        share = self.offloaded_numel / total_numel if total_numel else 0.0
        where = f"files under {self.store.dir}" if self.store is not None else "host memory"
        return (f"offload: {len(self.units)} units, {share:.1%} of the optimizer state to {where} "
                f"(optimizer {self.config.offload_optimizer}, parameters {self.config.offload_params}"
                f"{', pinned' if self.grads.pinned else ''})")

    # ---- placement -------------------------------------------------------------------------
    @torch.no_grad()
    def _move_masters(self) -> None:
        for unit, host in zip(self.units, self.masters.views):
            host.copy_(unit.master)
            unit.master = host
            for piece, where in zip(unit.pieces, unit.piece_of):
                if piece is not None:
                    piece.data = host[where.shard_start:where.shard_start + where.length]

    @torch.no_grad()
    def _place_param_shards(self, pin: bool) -> None:
        """Stage 3: the compute-dtype shard each gather starts from (see [Note: what moves])."""
        if not self.config.shard_params:
            return
        where = self.config.offload_params
        if where == "none":
            for unit in self.units:
                unit.param_shard = torch.empty(unit.layout.shard_numel, dtype=self.compute_dtype, device=self.device)
        # offload_params='cpu': gathers copy straight from the fp32 host master and convert on the device
        # (a 16-bit host copy would cost the CPU a conversion pass every step, beside its optimizer step)
        for unit in self.units:
            unit.refresh_param_shard()

    # ---- gradients -------------------------------------------------------------------------
    @torch.no_grad()
    def take_reduced(self, unit: FlatUnit, reduced: torch.Tensor, final: bool) -> None:
        """The reducer's sink: a unit's reduced gradient chunk (``final``: the window's last micro-batch)."""
        k = unit.index
        if k not in self.indices:
            unit.add_to_grad_shard(reduced)
            return
        if not final:
            acc = self._accum.get(k)
            self._accum[k] = reduced.float() if acc is None else acc.add_(reduced)
            return
        acc = self._accum.pop(k, None)
        if acc is not None:
            reduced = acc.add_(reduced)
        if unit.grad_shard is None:
            unit.grad_shard = self.grads.views[self._position[unit.index]]
            self._to_host(unit.grad_shard, reduced)
        else:  # a second reduction in the same window (late gradients): rare, so plainly synchronous
            self.wait_copies()
            unit.grad_shard.add_(reduced.to("cpu", torch.float32))

    def _to_host(self, host: torch.Tensor, reduced: torch.Tensor) -> None:
        if self.copy_stream is None or reduced.device.type != "cuda":
            host.copy_(reduced)
            return
        current = torch.cuda.current_stream(reduced.device)
        self.copy_stream.wait_stream(current)
        with torch.cuda.stream(self.copy_stream):
            host.copy_(reduced, non_blocking=self.grads.pinned)
            reduced.record_stream(self.copy_stream)  # the allocator must not reuse it before the copy ran
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        self._copies.append(event)

    def wait_copies(self) -> None:
        """Block until every gradient copy issued so far has landed in host memory."""
        for event in self._copies:
            event.synchronize()
        self._copies.clear()

    # ---- the step -------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, inner: Callable[[], Any],
             piece_of: Callable[[Any], Any], unit_of: Callable[[Any], FlatUnit],
             publish: Callable[[list[FlatUnit]], None]) -> Any:
        """Step the device part, then the host part chunk by chunk, publishing each chunk at once."""
        self.wait_copies()
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        units = [u for u in self.units if any(id(p) in mine for p in u.params)]

        def on_device(p: Any) -> Any:
            return None if unit_of(p).index in self.indices else piece_of(p)

        with pieces_in_groups(optimizer, on_device):
            out = inner()

        def step_chunk(chunk: list[FlatUnit]) -> Any:
            members = {u.index for u in chunk}

            def in_chunk(p: Any) -> Any:
                return piece_of(p) if unit_of(p).index in members else None

            with pieces_in_groups(optimizer, in_chunk), self._fast_host_kernels(optimizer):
                inner()
            publish(chunk)
            if not self.cuda:
                return None
            event = torch.cuda.Event()  # the chunk's host memory is read by queued copies until this
            event.record()
            return event

        if self.store is not None and self.store.masters:
            self.store.run(optimizer, self.store.chunks(units), step_chunk)
        else:
            for chunk in chunk_units([u.layout.shard_numel for u in units], HOST_STEP_CHUNK):
                step_chunk([units[i] for i in chunk])
        return out

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    @contextmanager
    def _fast_host_kernels(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """With a GPU for compute, step host pieces with torch's fused CPU kernel (one pass over memory,
        as fast as a hand-written CPU Adam) unless the user chose an implementation (foreach/fused/
        capturable/differentiable)."""
        flipped = []
        if self.cuda and isinstance(optimizer, _FUSABLE):
            for group in optimizer.param_groups:
                if ("fused" in group and not group["fused"] and not group.get("foreach")
                        and not group.get("capturable") and not group.get("differentiable")):
                    flipped.append((group, group["fused"]))
                    group["fused"] = True
        try:
            yield
        finally:
            for group, value in flipped:
                group["fused"] = value
