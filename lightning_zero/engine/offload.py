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
  window add into a device accumulator instead, so the slow link is crossed once per step
  (``offload_accumulation="device"``). With ``"host"`` every micro-batch's chunk goes down into
  one of two pinned staging slots and a worker thread adds it into the host gradient while
  the GPU runs on: no GPU memory for the offloaded gradients, PCIe crossed once per micro-batch.
- step: the device part is stepped first (its kernels are queued and run on the GPU), then the
  host steps its units chunk by chunk; after each chunk its new values are queued for the
  device (pinned, asynchronous) and all-gathered, while the CPU already steps the next chunk.
- overlap (``overlap_step``): with one optimizer, automatic optimization and no user hook before the
  step, a unit whose final gradient has landed on the host is stepped by a worker thread while
  backward goes on, in chunks, and its new values are copied back at once. Global clipping and the
  fp16 overflow vote need every gradient first: then the step is speculative (``speculative_step``,
  see :mod:`lightning_zero.engine.speculation`): the worker keeps what it overwrote, and the units are
  put back and stepped again after backward only when the norm clips or a rank overflowed.
- delayed (``delayed_step``): the host update of step t runs on a worker during window t+1; each unit's
  new values go up during that window's backward (see :mod:`lightning_zero.engine.delayed`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch.profiler import record_function

from ..config import ZeroConfig
from ..partition import plan_offload
from .delayed import DelayedStep, EarlyPublish
from .flat_unit import FlatUnit
from .host import HOST_STEP_CHUNK, HostArena, HostBackend
from .optim import fuse_on_host, lazy_state_bytes, pieces_in_groups, unwrap
from .overlap import OverlapWorker
from .swap import ASSUMED_STATE_KEYS, NvmeBackend, resolve_nvme_dir

__all__ = ["Offloader", "HOST_STEP_CHUNK"]

log = logging.getLogger(__name__)

PieceOf = Callable[[Any], Any]


class Offloader:
    """Places, feeds and steps the offloaded units of one engine.

    Args:
        units: the engine's units (index = backward finishing order).
        config: offload fields of the ZeRO config.
        device: the compute device.
        compute_dtype: dtype of the module's parameters.
    """

    def __init__(self, units: Sequence[FlatUnit], config: ZeroConfig, device: torch.device,
                 compute_dtype: torch.dtype, rank: int, piece_of: PieceOf, unit_of: Callable[[Any], FlatUnit]) -> None:
        self.config = config
        self.device = device
        self.compute_dtype = compute_dtype
        self.piece_of, self.unit_of = piece_of, unit_of  # parameter -> this rank's piece / its unit
        chosen = plan_offload([u.layout.shard_numel for u in units], config.offload_fraction)
        self.units = [units[i] for i in chosen]
        self.indices = {u.index for u in self.units}
        self._position = {u.index: i for i, u in enumerate(self.units)}
        self.cuda = device.type == "cuda"
        pin = config.pin_memory and self.cuda
        self.grads = HostArena([u.layout.shard_numel for u in self.units], torch.float32, pin)
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None  # device->host, stage-3 gathers
        self.up_stream = torch.cuda.Stream(device) if self.cuda else None  # host->device during backward
        self._copies: list[Any] = []  # events of device->host gradient copies not yet waited for
        self._accum: dict[int, torch.Tensor] = {}  # device accumulators of the window's earlier micro-batches
        # [Note: scale of host gradients] A chunk that lands in place in an empty host gradient is copied as
        # it was reduced, still scaled by the fp16 loss scale (a 16-bit copy crosses PCIe, a conversion would
        # double it); its unit's factor is kept here and applied on the host when the window closes. Chunks
        # added later in that window are added at the same scale; onto a gradient already true, unscaled.
        self._host_scale: dict[int, float] = {}
        self.host_accumulation = config.offload_accumulation == "host"
        self._adder: Optional[_HostAdder] = None  # staging slots: allocated below with the other host buffers
        self._announced: set[int] = set()  # units handed to the overlap this window (once each)
        self.overlap: Optional[OverlapWorker] = None  # set by enable_overlap when the step may start in backward
        self.stepped_in_backward = 0  # units stepped by the overlap worker (diagnostics, tests)
        self.speculations_undone = 0  # of those, units put back because the norm clipped or a rank overflowed
        self.batches_in_backward = 0  # of those, batches handed to it before backward ended
        self.seconds = {"host_step": 0.0, "wait_for_host": 0.0}  # summed over steps (diagnostics, benchmarks)
        nvme_masters = config.offload_optimizer == "nvme"
        nvme_params = config.shard_params and config.offload_params == "nvme"
        self.store: Optional[NvmeBackend] = None  # the NVMe files (masters and state, and/or parameter shards)
        if nvme_masters or nvme_params:
            per_elem = (4 * (1 + ASSUMED_STATE_KEYS) if nvme_masters else 0) + (compute_dtype.itemsize if nvme_params else 0)
            root = resolve_nvme_dir(config.nvme_path, per_elem * self.offloaded_numel)
            self.store = NvmeBackend(self.units, root, rank, config.nvme_buffer_bytes, pin, masters=nvme_masters,
                                     params_dtype=compute_dtype if nvme_params else None)
        # where the optimizer side lives and steps (see the backends' common interface in engine.host)
        self.backend: Any = self.store if nvme_masters else HostBackend(self.units, pin)
        if self.host_accumulation and self.units:  # every host buffer now, while the host budget was just checked
            self._adder = _HostAdder(max(u.layout.shard_numel for u in self.units), self.grads.pinned,
                                     self.copy_stream, self.seconds)
        # delayed_step: the update of step t runs on a worker while window t+1 lands in a second gradient arena
        self.delayed = DelayedStep(self.seconds) if config.delayed_step and self.units else None
        self._early = EarlyPublish(self.up_stream, device) if self.delayed is not None else None
        self._spare_grads = (HostArena([u.layout.shard_numel for u in self.units], torch.float32, pin)
                             if self.delayed is not None else None)
        self._unpublished: list[FlatUnit] = []  # updated by the delayed step, not yet on the device
        self.host_steps = 0  # steps of the offloaded units so far, this fit (delayed_step_warmup)
        if config.shard_params and config.offload_params == "none":  # stage 3: a device shard to gather from
            for unit in self.units:
                unit.set_param_shard(torch.empty(unit.layout.shard_numel, dtype=compute_dtype, device=device))
        # offload_params='cpu': gathers copy straight from the fp32 host master and convert on the device
        # (a 16-bit host copy would cost the CPU a conversion pass every step, beside its optimizer step)

    @property
    def host_adds(self) -> int:
        """Gradient chunks added on the host so far (``offload_accumulation="host"``)."""
        return self._adder.added if self._adder is not None else 0

    def _offloaded_pieces(self, optimizers: Sequence[Any]) -> Iterator[tuple[torch.optim.Optimizer, dict, Any]]:
        """(optimizer, group, piece) for this rank's piece of every trainable offloaded parameter of ``optimizers``."""
        for optimizer in optimizers:
            inner = unwrap(optimizer)
            for group in inner.param_groups:
                for p in group["params"]:
                    try:
                        if not p.requires_grad or self.unit_of(p).index not in self.indices:
                            continue
                        piece = self.piece_of(p)
                    except KeyError:  # not one of the engine's parameters: stepped where it lives
                        continue
                    if piece is not None:
                        yield inner, group, piece

    def pending_host_bytes(self, optimizers: Sequence[Any]) -> int:
        """Host bytes the next step still allocates: the state an optimizer creates lazily at its first step for
        the offloaded pieces it has none for yet (in host memory; the NVMe backend's buffers exist already)."""
        if self.store is not None and self.store.masters:
            return 0
        return sum(piece.numel() * lazy_state_bytes(inner, group)
                   for inner, group, piece in self._offloaded_pieces(optimizers) if not inner.state.get(piece))

    @property
    def offloaded_numel(self) -> int:
        return sum(u.layout.shard_numel for u in self.units)

    def describe(self, total_numel: int) -> str:
        share = self.offloaded_numel / total_numel if total_numel else 0.0
        where = f"files under {self.store.dir}" if self.store is not None else "host memory"
        return (f"offload: {len(self.units)} units, {share:.1%} of the optimizer state to {where} "
                f"(optimizer {self.config.offload_optimizer}, parameters {self.config.offload_params}"
                f"{', pinned' if self.grads.pinned else ''})")

    def enable_overlap(self, optimizer: torch.optim.Optimizer, inner: Callable[[], Any],
                       fully_used: Callable[[FlatUnit], bool], publish_own: Callable[[list[FlatUnit]], None],
                       speculative: bool = False) -> None:
        """Step host units during backward (see [Note: the pipeline]); ``speculative``: clipping or the
        overflow vote may still undo those steps (the caller checked that nothing else can change gradients)."""
        self.disable_overlap()
        if self.backend.steps_in_place:
            self.overlap = OverlapWorker(self, optimizer, inner, fully_used, publish_own, speculative)

    def disable_overlap(self) -> None:
        if self.overlap is not None:
            self.overlap.close()
            self.overlap = None

    @property
    def speculating(self) -> bool:
        return self.overlap is not None and self.overlap.speculative

    def speculated(self) -> list[FlatUnit]:
        """The units stepped speculatively this window so far (after waiting for the worker)."""
        if not self.speculating:
            return []
        self.overlap.wait()
        return [u for u in self.units if u.index in self.overlap.stepped]

    def reject_speculation(self, units: Optional[Sequence[FlatUnit]] = None) -> list[FlatUnit]:
        """Undo this window's speculative steps of ``units`` (all: None); the units undone."""
        if not self.speculating:
            return []
        return self.overlap.reject(list(self.units if units is None else units))

    def speculation_bytes(self, optimizers: Sequence[Any]) -> int:
        """Host bytes the backups of speculative steps take (master and state of every offloaded piece)."""
        return sum(piece.numel() * (4 + max(lazy_state_bytes(inner, group), 4 if type(inner).__name__ == "Adagrad" else 0))
                   for inner, group, piece in self._offloaded_pieces(optimizers))

    # ---- gradients -------------------------------------------------------------------------
    @torch.no_grad()
    def take_reduced(self, unit: FlatUnit, reduced: torch.Tensor, final: bool, unscale: float = 1.0) -> None:
        """The reducer's sink: a unit's reduced gradient chunk (``final``: the window's last micro-batch),
        to be stored times ``unscale`` (1/loss scale, see [Note: scale of host gradients]).

        An offloaded unit's chunk goes one of two ways: held on the device until the window's last
        micro-batch (``offload_accumulation="device"``), or down to the host now (:meth:`_land`).
        """
        if unit.index not in self.indices:
            unit.add_to_grad_shard(reduced, unscale)
            return
        if final and self._early is not None:  # delayed_step: its update may go up now (see [Note: early publish])
            self._early.backward_done(unit)
        held = self._accumulate_on_device(unit, reduced, final, unscale)
        if held is None:
            return
        event = self._land(unit, *held)
        if final and self.overlap is not None and unit.index not in self._announced:
            self._announced.add(unit.index)
            if self.overlap.accepts(unit):
                # speculative (fp16): the worker unscales this unit's host gradient before stepping it
                unscale = self._host_scale.pop(unit.index, 1.0) if self.overlap.speculative else 1.0
                self.overlap.ready(unit, event, unscale)

    def _accumulate_on_device(self, unit: FlatUnit, reduced: torch.Tensor, final: bool,
                              unscale: float) -> Optional[tuple[torch.Tensor, float]]:
        """Device accumulation: add earlier micro-batches into an fp32 GPU buffer; at the last one, the sum (and
        its scale) goes down. Host accumulation: every chunk goes down as it comes. None: nothing to land yet."""
        k = unit.index
        if self.host_accumulation:
            return reduced, unscale
        acc = self._accum.get(k)
        if not final:
            if acc is None:
                self._accum[k] = reduced.float().mul_(unscale) if unscale != 1.0 else reduced.float()
            else:
                acc.add_(reduced, alpha=unscale)
            return None
        if acc is None:
            return reduced, unscale
        del self._accum[k]
        return acc.add_(reduced, alpha=unscale), 1.0

    def _land(self, unit: FlatUnit, chunk: torch.Tensor, unscale: float) -> Any:
        """Put a chunk into the unit's host gradient: in place when the gradient is empty (a copy queued on the
        side stream), else added to it (on the host adder's thread, or at once when that is rare); the event
        or pending add to wait for before the host reads it."""
        k = unit.index
        if unit.grad_shard is None:  # the window's first chunk for this unit lands in place
            self._announced.discard(k)
            unit.attach_grad_shard(self.grads.views[self._position[k]])
            self._host_scale[k] = unscale  # the host multiplies once the copy landed (finish_window)
            return self._to_host(unit.grad_shard, chunk)
        alpha = unscale / self._host_scale.get(k, 1.0)
        if self._adder is not None:
            return self._adder.add(unit.grad_shard, chunk, alpha)
        # device accumulation reaching a non-empty host gradient: a late gradient, or one kept since an
        # earlier window (DDP's rule): rare, so plainly synchronous
        self.wait_copies()
        unit.grad_shard.add_(chunk.to("cpu", torch.float32), alpha=alpha)
        return None

    @torch.no_grad()
    def finish_window(self) -> None:
        """Every gradient copy has landed and every host gradient holds true (unscaled) values."""
        # a window closed before its last micro-batch (an epoch that ended mid-window, a norm read in a hook): what the
        # device accumulators hold is part of the gradient from here on (the owner's zero_grad drops it, as DDP's)
        for k in list(self._accum):
            self._land(self.units[self._position[k]], self._accum.pop(k), 1.0)
        if self.speculating:  # the norm and the vote read the gradients the worker unscales, and the optimizer's
            self.overlap.wait()  # groups, which hold pieces while the worker steps
        self.wait_copies()
        for k, unscale in self._host_scale.items():
            if unscale != 1.0:
                grad = self.units[self._position[k]].grad_shard
                if grad is not None:
                    grad.mul_(unscale)
        self._host_scale.clear()

    def _to_host(self, host: torch.Tensor, reduced: torch.Tensor) -> Any:
        event = _copy_down(self.copy_stream, host, reduced, self.grads.pinned)
        if event is not None:
            self._copies.append(event)
        return event

    def wait_copies(self) -> None:
        """Block until every gradient copy issued so far has landed in host memory."""
        for event in self._copies:
            event.synchronize()
        self._copies.clear()
        if self._adder is not None:
            self._adder.wait()

    # ---- the delayed step ---------------------------------------------------------------------
    def settle(self, publish: Optional[Callable[[list[FlatUnit], frozenset[int]], None]] = None) -> None:
        """Wait for the delayed update, if one runs (the master and state are then whole); with ``publish``
        (a collective: every rank calls it at the same point) its values go to the device."""
        if self.delayed is None:
            return
        settled = self.delayed.settle()
        early = self._early.finish()
        if publish is None:  # those published early are published again then (the master is the truth)
            self._unpublished += [u for u in settled if u not in self._unpublished]
            return
        units = self._unpublished + [u for u in settled if u not in self._unpublished]
        fresh = early - {u.index for u in self._unpublished}
        self._unpublished = []
        if units:
            publish(units, fresh)

    def late_gradient(self, unit: FlatUnit) -> None:
        """The reducer's report of a gradient reaching ``unit`` after its backward was done (delayed_step)."""
        if self._early is not None and not self._early.late(unit):
            raise RuntimeError(
                f"lightning_zero delayed_step: parameters {unit.names[:3]} received a gradient after their unit's "
                f"backward was done and its delayed update had been published (a parameter whose gradient arrives "
                f"twice in one backward, e.g. under reentrant activation checkpointing: use "
                f"torch.utils.checkpoint with use_reentrant=False, or set ZeroConfig(delayed_step=False)).")

    @property
    def in_flight(self) -> list[FlatUnit]:
        """Units whose update the delayed step is running: the device keeps their old values until settled."""
        return list(self.delayed.units) if self.delayed is not None and self.delayed.running else []

    def _step_later(self, optimizer: torch.optim.Optimizer, units: list[FlatUnit],
                    every_rank: Callable[[bool], bool]) -> bool:
        """Hand this step's host update to the delayed worker; False when it must run now (some piece has no
        optimizer state yet, on some rank: torch creates it lazily, in the real optimizer)."""
        def by_group(members: set[int]) -> list[list[torch.nn.Parameter]]:
            return [[q for q in (self.piece_of(p) for p in group["params"] if p.requires_grad
                                 and self.unit_of(p).index in members) if q is not None and q.grad is not None]
                    for group in optimizer.param_groups]

        chunks = [(chunk, by_group({u.index for u in chunk})) for chunk in self.backend.chunks(units)]
        if not every_rank(DelayedStep.ready(optimizer, [q for _, g in chunks for pieces in g for q in pieces])):
            return False
        after = None
        if self.cuda:  # everything queued so far (the previous update's uploads from the master) runs first
            after = torch.cuda.Event()
            after.record()
        self._early.start(units)
        self.delayed.launch(optimizer, chunks, fused=self.cuda, after=after,  # fused: as _fast_host_kernels
                            on_stepped=self._early.on_stepped)
        self.grads, self._spare_grads = self._spare_grads, self.grads  # the next window lands in the other arena
        return True

    # ---- the step -------------------------------------------------------------------------
    def units_of(self, optimizer: torch.optim.Optimizer) -> list[FlatUnit]:
        """The offloaded units holding parameters of ``optimizer`` (the same list on every rank)."""
        mine = {id(p) for group in unwrap(optimizer).param_groups for p in group["params"]}
        return [u for u in self.units if any(id(p) in mine for p in u.params)]

    def step(self, optimizer: torch.optim.Optimizer, inner: Callable[[], Any],
             publish: Callable[[list[FlatUnit]], None],
             agree: Callable[[set[int], list[FlatUnit]], set[int]] = lambda early, units: early,
             every_rank: Callable[[bool], bool] = lambda flag: flag) -> Any:
        """Step the device part, then the host part chunk by chunk, publishing each chunk at once.

        ``agree(early, units)``: of ``units``, those stepped during backward on every rank. Which units a
        rank stepped early is its own (a unit some of whose parameters it did not use waits for the step),
        but publishing gathers from all ranks: every rank walks the same chunks, stepping only what it has
        not stepped yet.
        """
        early = self.overlap.drain() if self.overlap is not None else set()
        self.wait_copies()
        units = self.units_of(optimizer)
        everywhere = agree(early, units) if self.overlap is not None else early
        units = [u for u in units if u.index not in everywhere]

        def on_device(p: Any) -> Any:
            return None if self.unit_of(p).index in self.indices else self.piece_of(p)

        with pieces_in_groups(optimizer, on_device), record_function("zero/device_step"):
            out = inner()
        if self.delayed is not None and units:
            self.host_steps += 1  # the steps before the delay begins (delayed_step_warmup) run here, exactly
            if self.host_steps > self.config.delayed_step_warmup and self._step_later(optimizer, units, every_rank):
                return out
        start = time.perf_counter()
        self.step_units(optimizer, inner, units, publish, stepped=early)
        self.seconds["host_step"] += time.perf_counter() - start
        return out

    def step_units(self, optimizer: torch.optim.Optimizer, inner: Callable[[], Any], units: list[FlatUnit],
                   publish: Callable[[list[FlatUnit]], None], label: str = "host_step",
                   stepped: frozenset[int] | set[int] = frozenset()) -> None:
        """Step offloaded ``units`` through the backend, chunk by chunk, publishing each chunk once stepped:
        the one body of the host step, after backward or (the overlap worker) during it. Units in
        ``stepped`` were stepped already: only published."""

        def body(chunk: list[FlatUnit]) -> Any:
            members = {u.index for u in chunk if u.index not in stepped}

            def in_chunk(p: Any) -> Any:
                return self.piece_of(p) if self.unit_of(p).index in members else None

            if members:
                with record_function(f"zero/{label}[units {chunk[0].index}-{chunk[-1].index}]"), \
                        pieces_in_groups(optimizer, in_chunk), self._fast_host_kernels(optimizer):
                    inner()
            with record_function("zero/publish"):
                publish(chunk)
            if not self.cuda:
                return None
            event = torch.cuda.Event()  # the chunk's host memory is read by queued copies until this
            event.record()
            return event

        if units:
            self.backend.run(optimizer, self.backend.chunks(units), body)

    def close(self) -> None:
        self.disable_overlap()
        if self.delayed is not None:
            self.delayed.close()
        if self._adder is not None:
            self._adder.close()
            self._adder = None
        self.backend.close()
        if self.store is not None:
            self.store.close()

    @contextmanager
    def _fast_host_kernels(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """With a GPU for compute, step host pieces with torch's fused CPU kernel (one pass over memory,
        as fast as a hand-written CPU Adam) unless the user chose an implementation (foreach/fused/
        capturable/differentiable)."""
        flipped = []
        if self.cuda:
            for group in optimizer.param_groups:
                if fuse_on_host(optimizer, group):
                    flipped.append((group, group["fused"]))
                    group["fused"] = True
        try:
            yield
        finally:
            for group, value in flipped:
                group["fused"] = value


def _copy_down(stream: Any, host: torch.Tensor, reduced: torch.Tensor, pinned: bool) -> Any:
    """Copy a reduced chunk into host memory: queued on ``stream`` after the work that produced it (the CUDA
    event to wait for is returned), or at once without CUDA (None)."""
    if stream is None or reduced.device.type != "cuda":
        host.copy_(reduced)
        return None
    stream.wait_stream(torch.cuda.current_stream(reduced.device))
    with torch.cuda.stream(stream), record_function("zero/offload_grad_to_host"):
        host.copy_(reduced, non_blocking=pinned)
        reduced.record_stream(stream)  # the allocator must not reuse it before the copy ran
        event = torch.cuda.Event()
        event.record(stream)
    return event


class _HostAdder:
    """Adds reduced gradient chunks into host gradients on a worker thread (``offload_accumulation="host"``).

    Each chunk is copied device->host on the copy stream into one of two pinned staging slots; the
    worker waits for that copy and adds the slot into the target, so the Python thread that queues
    backward never waits for the link or the CPU. A slot is reused only after its last add finished.
    """

    SLOTS = 2

    def __init__(self, largest: int, pin: bool, stream: Any, seconds: dict[str, float]) -> None:
        self.staging = HostArena([largest] * self.SLOTS, torch.float32, pin)
        self.stream = stream
        self.seconds = seconds
        self.seconds.setdefault("host_accumulate", 0.0)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lz-host-accumulate")
        self.busy: list[Optional[Future]] = [None] * self.SLOTS
        self.pending: list[Future] = []
        self.next = 0
        self.added = 0  # chunks added (diagnostics, tests)

    def add(self, target: torch.Tensor, reduced: torch.Tensor, alpha: float = 1.0) -> _Pending:
        i, self.next = self.next, (self.next + 1) % self.SLOTS
        if self.busy[i] is not None:
            self.busy[i].result()
        slot = self.staging.views[i][:reduced.numel()]
        event = _copy_down(self.stream, slot, reduced, self.staging.pinned)  # the reducer may then reuse it
        future = self.pool.submit(self._add, target, slot, event, alpha)
        self.added += 1
        self.busy[i] = future
        self.pending.append(future)
        return _Pending(future)

    def _add(self, target: torch.Tensor, slot: torch.Tensor, event: Any, alpha: float) -> None:
        if event is not None:
            event.synchronize()
        start = time.perf_counter()
        with torch.no_grad(), record_function("zero/host_accumulate"):
            target.add_(slot, alpha=alpha)
        self.seconds["host_accumulate"] += time.perf_counter() - start

    def wait(self) -> None:
        pending, self.pending = self.pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class _Pending:
    """A queued host add, waited for like a CUDA event (the overlap steps a unit only after it)."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def synchronize(self) -> None:
        self.future.result()
