"""FlatUnit: the buffers of one sharded unit of parameters.

[Note: buffers of a unit]
- ``full``   1D, padded, compute dtype: every rank's parameters side by side; module
  parameters are views into it while the unit is UNSHARDED. The tensor and its storage
  object never change: stage 3 frees it by resizing the storage to zero bytes and gathers
  into the same storage again. Views that autograd or a compiled graph saved during
  forward therefore stay valid when backward re-gathers the unit.
- ``master`` 1D fp32, this rank's chunk: the values the optimizer steps. With fp32
  compute and a kept ``full`` (stages 1/2) it is a view of ``full`` (no copy).
- ``pieces`` one ``nn.Parameter`` per parameter this rank owns part of: a view of
  ``master`` holding exactly that part. The user's optimizer steps the pieces, so each
  parameter keeps its own optimizer state, step count and ``grad is None`` semantics.
- ``grad_shard`` 1D fp32, this rank's chunk of the reduced gradient (pieces' ``.grad``
  are views of it); alive from the first reduction of a window until the owning optimizer's
  ``zero_grad()`` (or the step, see [Note: when gradients are freed] in the engine).
- ``grad_full`` 1D, padded: the gradient buffer that hooks copy into and that is
  reduce-scattered; transient per micro-batch in stages 2/3, kept across the accumulation
  window in stage 1.

[Note: sharded parameters]
While a stage-3 unit is SHARDED each parameter's ``.data`` is an empty placeholder of
shape ``(0, k)`` with ``k`` unique to the parameter: any use fails loudly instead of
reading freed memory, and ``torch.equal`` still tells two sharded parameters apart (as
Lightning's fine-tuning callbacks need).

[Note: a module moved after fit]
Lightning's teardown moves the module to the CPU, as DDP's module is after fit, and a user may move it
anywhere with ``module.to(...)``: the placeholders move with it. A gather then still runs on the
compute device (the shards live there) and the parameters are shown where the placeholders were, as a
copy (``shown``); placeholders stay there after the release, so ``next(module.parameters()).device``
and a forward with inputs on that device behave as under DDP. An in-place change of the shown copy
is copied back before the unit's edits are taken.

[Note: replaced parameter data]
``p.data = tensor`` (Lightning's ModelPruning resets weights that way for the lottery ticket; user code
loading values) makes the parameter hold another tensor, no longer a view of the unit's buffer: the forward
would compute with it while the optimizer steps the master. Under DDP the parameter simply holds the new
values from then on, so :meth:`FlatUnit.take_replaced` takes them as values: into this rank's part of the
master (at full precision: an fp32 tensor given to a bf16 module keeps its fp32 bits there, as DDP's fp32
parameter would) and into the buffer, and the parameter becomes a view (or a placeholder) again. The
given tensor is kept (``aliases``): under DDP it *is* the parameter from then on, so whatever else holds it
(ModelPruning's copy of the initial weights, which the next reset reads) sees every later step; the engine
copies each step's new values into it.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..partition import Piece, UnitLayout

__all__ = ["UnitState", "FlatUnit", "ShardedParameterEditError", "ReplacedParameterError", "EDIT_CHUNK"]

EDIT_CHUNK = 1 << 24  # elements compared at a time for edits of published values (bounds the temporaries)


class ShardedParameterEditError(RuntimeError):
    """A stage-3 parameter was changed in place while it was only a placeholder (the change would be lost)."""


class ReplacedParameterError(RuntimeError):
    """A parameter was given data (``p.data = ...``) the engine cannot take (another shape; NVMe or delayed masters)."""


class UnitState(enum.Enum):
    UNSHARDED = "unsharded"  # parameters are views into ``full``
    SHARDED = "sharded"  # ``full`` has no memory; parameters are placeholders


@dataclass(eq=False, repr=False)
class FlatUnit:
    """One unit of parameters laid out by :func:`lightning_zero.partition.layout_unit`.

    Args:
        index: position in the engine's unit list (the same on every rank).
        params: the unit's parameters, in layout order.
        names: their fully qualified names in the module.
        layout: slots and the even split across ranks.
        rank: this rank's index in the sharding group.
        compute_dtype: dtype of the module's parameters and gradients.
    """

    index: int
    params: list[nn.Parameter]
    names: list[str]
    layout: UnitLayout
    rank: int
    compute_dtype: torch.dtype
    shapes: list[torch.Size] = field(default_factory=list)
    state: UnitState = UnitState.UNSHARDED
    full: Optional[torch.Tensor] = None
    views: list[torch.Tensor] = field(default_factory=list)
    placeholders: list[torch.Tensor] = field(default_factory=list)
    master: Optional[torch.Tensor] = None
    pieces: list[Optional[nn.Parameter]] = field(default_factory=list)  # per slot
    spans: list[Optional[Piece]] = field(default_factory=list)  # per slot: where this rank's piece lies (layout)
    grad_shard: Optional[torch.Tensor] = None
    grad_full: Optional[torch.Tensor] = None
    param_shard: Optional[torch.Tensor] = None  # offloaded stage-3 unit: compute-dtype shard to gather from
    home: Optional[torch.device] = None  # the compute device (the master may live on the host)
    after_param_io: Optional[Callable[[], None]] = None  # NVMe: release the mapped pages of ``param_shard``
    released_versions: list[int] = field(default_factory=list)  # the parameters' ``_version`` when last sharded
    # the host step's worker publishes into ``full`` while the main thread may free it (stage 3, after the unit's
    # backward): the two take turns
    full_lock: threading.Lock = field(default_factory=threading.Lock)
    published_marks: Optional[torch.Tensor] = None  # offloaded unit: fingerprints of its published chunk (edit_marks)
    shown: Optional[torch.device] = None  # where the user moved the sharded module, if not ``device`` (see the Note)
    shown_full: Optional[torch.Tensor] = None  # the gathered values copied there while gathered
    aliases: dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> tensor a user gave it (`p.data = t`)

    def __repr__(self) -> str:
        # not the dataclass's: printing a tensor whose storage stage 3 gave back reads freed memory (a traceback
        # shown by pytest or a debugger would crash the process)
        return f"FlatUnit(index={self.index}, state={self.state.value}, params={self.names[:3]}{'...' if len(self.names) > 3 else ''})"

    @property
    def shard_slice(self) -> slice:
        lo, hi = self.layout.shard_range(self.rank)
        return slice(lo, hi)

    @property
    def device(self) -> torch.device:
        """Where compute buffers (``full``, gradient buffers) live, wherever the master is."""
        return self.home if self.home is not None else self.master.device

    @property
    def full_bytes(self) -> int:
        return self.layout.padded_numel * torch.empty((), dtype=self.compute_dtype).element_size()

    def param_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views (parameter shapes) of any full-size flat tensor of this unit."""
        return [flat[s.offset:s.end].view(shape) for s, shape in zip(self.layout.slots, self.shapes)]

    # ---- construction ---------------------------------------------------------------------
    def build(self, staging: torch.Tensor, keep_full: bool, placeholder_ids: list[int]) -> None:
        """Take an fp32 full-size flat tensor (identical on all ranks) as the unit's values."""
        self.home = staging.device
        self.full = staging if self.compute_dtype == torch.float32 else staging.to(self.compute_dtype)
        self.views = self.param_views(self.full)
        if keep_full and self.compute_dtype == torch.float32:
            self.master = self.full[self.shard_slice]
        else:
            self.master = staging[self.shard_slice].clone()
        self.spans = [None] * len(self.params)
        self.pieces = [None] * len(self.params)
        for piece in self.layout.pieces(self.rank):
            start = piece.shard_start
            self.spans[piece.index] = piece
            self.pieces[piece.index] = nn.Parameter(self.master[start:start + piece.length], requires_grad=True)
        self.placeholders = [torch.empty((0, k + 1), dtype=self.compute_dtype, device=self.device)
                             for k in placeholder_ids]
        self.point_params_at_full()
        if not keep_full:
            # the full size where counting code looks under DeepSpeed's ZeRO-3 (PEFT's and Hugging Face's
            # trainable-parameter counts, DeepSpeed scripts): numel() of a placeholder is 0
            for param, shape in zip(self.params, self.shapes):
                param.ds_numel, param.ds_shape = shape.numel(), shape
            self.release_full()

    # ---- where the optimizer side lives (offload, NVMe, after fit) ------------------------------
    def set_master(self, master: torch.Tensor) -> None:
        """Make ``master`` (this rank's chunk, fp32) the unit's master: every piece becomes a view of it.
        The caller filled it (a host arena, a mapped file, a staging slot)."""
        self.master = master
        for piece, where in zip(self.pieces, self.spans):
            if piece is not None:
                piece.data = master[where.shard_start:where.shard_start + where.length]

    def set_param_shard(self, shard: Optional[torch.Tensor], after_io: Optional[Callable[[], None]] = None) -> None:
        """Stage 3 with offload: the compute-dtype shard gathers start from (``after_io`` runs after each read)."""
        self.param_shard, self.after_param_io = shard, after_io
        if shard is not None:
            self.refresh_param_shard()

    def park(self) -> None:
        """After fit: the master moves to host memory (an offloaded one is there already), gradients go."""
        master = self.master.detach()
        self.set_master(master if master.device.type == "cpu" else master.to("cpu"))
        for piece in self.pieces:
            if piece is not None:
                piece.grad = None
        for param in self.params:
            param.grad = None
        self.grad_shard = self.grad_full = None

    def give_params(self, values: torch.Tensor, device: Optional[torch.device], copy: bool) -> None:
        """The module's parameters become plain tensors holding ``values`` (a full flat tensor of this unit)
        on ``device``; the unit keeps no compute buffer."""
        for param, view in zip(self.params, self.param_views(values)):
            param.data = view.to(device or view.device, copy=copy) if copy or device is not None else view
            param.grad = None
        self.drop_full()

    def drop_full(self) -> None:
        """Forget the flat compute buffer (the module holds its parameters elsewhere)."""
        self.full, self.views = None, []

    def forget(self) -> None:
        """After the module got its parameters back as copies: let go of every buffer. Each piece (what the
        optimizer holds) becomes empty, since an optimizer still referenced elsewhere would keep the master."""
        for piece in self.pieces:
            if piece is not None:
                piece.data, piece.grad = piece.data.new_empty(0), None
        self.drop_full()
        self.master = self.grad_shard = self.grad_full = self.param_shard = None

    def restore_params(self) -> None:
        """Point the parameters at the unit's buffer (or placeholders) again after something replaced their
        ``.data`` (Lightning's teardown moves the module to the CPU; a trainer's evaluation after fit moves it
        back): the module is on the compute device again."""
        self.shown, self.shown_full = None, None
        if self.state is UnitState.UNSHARDED:
            self.point_params_at_full()
        else:
            for param, placeholder in zip(self.params, self.placeholders):
                param.data = placeholder

    # ---- state transitions ------------------------------------------------------------------
    def moved_to(self) -> Optional[torch.device]:
        """Sharded: the device the user moved the module to, when not the compute device (see [Note: a module
        moved after fit]); None otherwise."""
        if self.state is not UnitState.SHARDED or not self.params:
            return None
        where = self.params[0].device
        return None if where == self.device else where

    def point_params_at_full(self, shown: Optional[torch.device] = None) -> None:
        """The parameters become views of ``full``, or of a copy of it on ``shown``."""
        self.shown = shown
        self.shown_full = None if shown is None else self.full.to(shown, copy=True)
        for param, view in zip(self.params, self.views if shown is None else self.param_views(self.shown_full)):
            param.data = view
        self.state = UnitState.UNSHARDED

    @torch.no_grad()
    def pull_shown(self) -> None:
        """Gathered and shown elsewhere: the shown copy (which user code may have changed in place) into ``full``."""
        if self.shown_full is not None and self.state is UnitState.UNSHARDED:
            self.full.copy_(self.shown_full)

    def release_full(self) -> None:
        """Stage 3: parameters become placeholders and ``full`` gives its memory back."""
        with self.full_lock:
            shown = self.shown
            for param, placeholder in zip(self.params, self.placeholders):
                param.data = placeholder if shown is None else placeholder.to(shown)
            self.shown_full = None
            self.free_storage()
            self.state = UnitState.SHARDED
        self.forget_edits()  # from here an in-place edit of a placeholder bumps its parameter's version

    def compute_in(self, dtype: torch.dtype) -> None:
        """Stage 3, sharded: gathers give ``dtype`` values of the fp32 master from now on, without a
        compute-dtype shard (after a fit in mixed precision the module computes in fp32 outside the trainer,
        as DDP's module does)."""
        assert self.state is UnitState.SHARDED and not self.storage_alive, "compute_in needs a sharded unit"
        self.compute_dtype = dtype  # the buffer of that dtype comes with the next gather (alloc_storage)
        self.placeholders = [torch.empty(p.shape, dtype=dtype, device=p.device) for p in self.placeholders]
        self.param_shard, self.after_param_io = None, None
        for param, placeholder in zip(self.params, self.placeholders):
            param.data = placeholder
        self.forget_edits()

    def alloc_storage(self) -> None:
        if self.full.dtype != self.compute_dtype:  # after compute_in: a buffer of the new dtype, and its views
            self.full = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype, device=self.device)
            self.views = self.param_views(self.full)
            return
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.full_bytes)

    def free_storage(self) -> None:
        self.full.untyped_storage().resize_(0)

    @property
    def storage_alive(self) -> bool:
        return self.full is not None and self.full.untyped_storage().nbytes() > 0

    def gather_source(self) -> torch.Tensor:
        """This rank's chunk in compute dtype on the compute device, as all-gather input."""
        src = self.param_shard if self.param_shard is not None else self.master
        if src.dtype == self.compute_dtype and src.device == self.device:
            return src
        if self.state is UnitState.UNSHARDED or self.storage_alive:
            chunk = self.full[self.shard_slice]
            _to_device(chunk, src)
        else:
            chunk = src.to(device=self.device, dtype=self.compute_dtype)
        if self.after_param_io is not None:
            self.after_param_io()
        return chunk

    def refresh_param_shard(self) -> None:
        """After the master changed: the compute-dtype shard stage 3 gathers from follows it."""
        if self.param_shard is not None:
            _to_device(self.param_shard, self.master)
            if self.after_param_io is not None:
                self.after_param_io()

    def forget_edits(self) -> None:
        """Stage 3, sharded: the parameters' versions now, against which :meth:`check_placeholders` compares (at
        each release; after GatheredParameters with a modifier rank, whose changes went into the master)."""
        if self.state is UnitState.SHARDED:
            self.released_versions = [param._version for param in self.params]

    def replaced(self) -> list[int]:
        """Slots whose parameter holds data that is not the unit's (see [Note: replaced parameter data])."""
        if self.full is None:  # parked after fit
            return []
        if self.state is UnitState.UNSHARDED:
            return [i for i, (p, v) in enumerate(zip(self.params, self._shown_views()))
                    if p.data_ptr() != v.data_ptr() or p.shape != v.shape]
        return [i for i, p in enumerate(self.params) if p.numel() != 0]  # a placeholder holds no element

    def _shown_views(self) -> list[torch.Tensor]:
        return self.views if self.shown_full is None else self.param_views(self.shown_full)

    @torch.no_grad()
    def take_replaced(self, slots: list[int]) -> None:
        """The values parameters were given by ``p.data = ...`` become the unit's (master and buffer); the
        parameters are the unit's views (or placeholders) again."""
        shown_views = self._shown_views() if self.state is UnitState.UNSHARDED else []
        for i in slots:
            param, shape = self.params[i], self.shapes[i]
            if param.shape != shape:
                raise ReplacedParameterError(
                    f"Parameter {self.names[i]!r} was given data of shape {tuple(param.shape)} (`p.data = ...`), but it "
                    f"has shape {tuple(shape)}: the engine keeps parameters in flat buffers laid out at setup. Change "
                    f"shapes before the Trainer starts (in __init__ or configure_model).")
            given = param.data
            values = given.detach().reshape(-1)
            self.aliases[i] = given  # shares the user's storage: later steps are copied into it (see the Note)
            span = self.spans[i]
            if span is not None:
                self.master[span.shard_start:span.shard_start + span.length].copy_(
                    values[span.param_start:span.param_start + span.length])
            if self.state is UnitState.UNSHARDED:
                self.views[i].copy_(values.view(shape))
                shown = shown_views[i]
                if shown is not self.views[i]:
                    shown.copy_(values.view(shape))
                param.data = shown
            else:
                param.data = self.placeholders[i] if self.shown is None else self.placeholders[i].to(self.shown)
        if slots:
            self.refresh_param_shard()
            self.forget_edits()

    def check_placeholders(self) -> None:
        """A stage-3 parameter changed in place while it was an empty placeholder: the change would be lost."""
        if self.state is not UnitState.SHARDED:
            return
        edited = [n for n, p, v in zip(self.names, self.params, self.released_versions) if p._version != v]
        if edited:
            raise ShardedParameterEditError(
                f"{', '.join(repr(n) for n in edited[:3])} changed in place while sharded: under stage 3 a "
                f"parameter is an empty placeholder between forwards, so the change would be lost. Make it on "
                f"every rank inside `with lightning_zero.zero.GatheredParameters(params, modifier_rank=0):`, "
                f"which writes it into the fp32 master.")

    @torch.no_grad()
    def edit_flags(self) -> list[tuple[int, int, torch.Tensor]]:
        """[Note: edits of published values] Values a user wrote into the module's parameters since they were
        published (WGAN weight clipping, an average a callback copies in) must become the fp32 master values, as
        under DDP, where the parameters are the master. Per chunk of this rank's part: (lo, hi, a device flag:
        does any element differ from the master's compute-dtype value). Chunks bound the temporaries; the caller
        reads every flag with one sync and takes the changed chunks (:meth:`take_edits`)."""
        if self.state is not UnitState.UNSHARDED or self.full is None or self.master is None or not self.storage_alive:
            return []
        own = self.full[self.shard_slice]
        if own.dtype == self.master.dtype and own.data_ptr() == self.master.data_ptr():
            return []  # fp32 compute: the parameters are views of the master itself
        flags = []
        for lo in range(0, own.numel(), EDIT_CHUNK):
            hi = min(lo + EDIT_CHUNK, own.numel())
            master = self.master[lo:hi].to(own.device)  # an offloaded master: compared on the device
            flags.append((lo, hi, (own[lo:hi] != master.to(own.dtype)).any()))
        return flags

    @torch.no_grad()
    def edit_marks(self) -> Optional[torch.Tensor]:
        """Per chunk of this rank's published values, two fingerprints on the device: the exact integer sum of their
        bit patterns (any one changed element changes it) and their fp32 norm (which moves under most changes that
        keep that sum; an edit that only permutes values keeps both). A unit whose master is on the host compares
        these with the ones taken when it was published instead of copying its master to the device at every step;
        each reads the values once, with no temporaries. None when not gathered."""
        if self.state is not UnitState.UNSHARDED or self.full is None or not self.storage_alive:
            return None
        own = self.full[self.shard_slice]
        bits = own.view(torch.int16 if own.element_size() == 2 else torch.int32)
        marks = []
        for lo in range(0, own.numel(), EDIT_CHUNK):
            values = own[lo:lo + EDIT_CHUNK]
            norm = torch.linalg.vector_norm(values, dtype=torch.float32)
            marks.append(torch.stack([bits[lo:lo + EDIT_CHUNK].sum(dtype=torch.int64), norm.view(torch.int32).long()]))
        return torch.stack(marks) if marks else None

    def mark_published(self) -> None:
        self.published_marks = self.edit_marks()

    def marked_edit_flags(self) -> list[tuple[int, int, torch.Tensor]]:
        """:meth:`edit_flags` from the fingerprints: chunks whose published values changed since
        :meth:`mark_published` (each then compared with the master in :meth:`take_edits`). Unmarked: every chunk."""
        now = self.edit_marks()
        if now is None:
            return []
        n = self.layout.shard_numel
        chunks = [(lo, min(lo + EDIT_CHUNK, n)) for lo in range(0, n, EDIT_CHUNK)]
        if self.published_marks is None or self.published_marks.shape != now.shape:
            return [(lo, hi, torch.ones((), dtype=torch.bool, device=now.device)) for lo, hi in chunks]
        changed = (now != self.published_marks).any(dim=1)
        return [(lo, hi, changed[i]) for i, (lo, hi) in enumerate(chunks)]

    @torch.no_grad()
    def take_edits(self, lo: int, hi: int) -> None:
        """The elements of ``[lo, hi)`` that differ from the master become master values; the others keep their
        fp32 bits."""
        own = self.full[self.shard_slice][lo:hi]
        master = self.master[lo:hi].to(own.device)
        self.master[lo:hi].copy_(torch.where(own != master.to(own.dtype), own.to(master.dtype), master))

    def publish_own(self) -> None:
        """After the master changed: this rank's chunk of the device values follows it (the compute-dtype shard,
        and the chunk's place in the full buffer while gathered); the other ranks' chunks come with a gather."""
        self.refresh_param_shard()
        with self.full_lock:  # called from the host step's worker: ``full`` stays alive until the copy is queued
            if self.state is not UnitState.UNSHARDED:
                return
            own = self.full[self.shard_slice]
            src = self.gather_source()  # stages 1/2: writes ``own`` itself; stage 3: the refreshed shard
            if src.data_ptr() != own.data_ptr():
                own.copy_(src)
            if own.is_cuda:  # queued on a side stream: a free of ``full`` on the compute stream waits for it
                own.record_stream(torch.cuda.current_stream(own.device))

    def own_chunk(self) -> torch.Tensor:
        """This rank's chunk on the device as it is now (after :meth:`publish_own`), as all-gather input."""
        if self.param_shard is not None and self.param_shard.device == self.device:
            return self.param_shard
        return self.full[self.shard_slice]

    @property
    def source_on_host(self) -> bool:
        """Gathers start with a copy from host memory (offloaded master or parameter shard)."""
        src = self.param_shard if self.param_shard is not None else self.master
        return src.device.type == "cpu" and self.device.type != "cpu"

    # ---- gradients ----------------------------------------------------------------------------
    def start_grad_full(self, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed full-size gradient buffer for the hooks to copy into (see engine.grads)."""
        self.grad_full = torch.zeros(self.layout.padded_numel, dtype=dtype, device=self.device)
        return self.grad_full

    def take_grad_full(self) -> Optional[torch.Tensor]:
        """Hand the full-size gradient buffer to the reduction; the unit no longer holds it."""
        full, self.grad_full = self.grad_full, None
        return full

    def attach_grad_shard(self, shard: torch.Tensor) -> None:
        """A gradient shard that lives elsewhere (an offloaded unit's host arena view); filled by the caller."""
        self.grad_shard = shard

    def give_grad(self, slot: int) -> None:
        """The piece of parameter ``slot`` (if this rank has one) gets its gradient view, unless it has one."""
        piece = self.pieces[slot]
        if piece is not None and piece.grad is None:
            piece.grad = self.grad_view(slot)

    def drop_grad(self, slot: int) -> Optional[torch.Tensor]:
        """The piece of parameter ``slot`` forgets its gradient; returns the view it had (None if none)."""
        piece = self.pieces[slot]
        if piece is None or piece.grad is None:
            return None
        grad, piece.grad = piece.grad, None
        return grad

    def grad_view(self, slot_index: int) -> torch.Tensor:
        """This rank's piece of ``grad_shard`` for one parameter (the piece's ``.grad``)."""
        if self.grad_shard is None:  # next to the master: a piece and its gradient share a device
            self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=self.master.device)
        piece = self.spans[slot_index]
        return self.grad_shard[piece.shard_start:piece.shard_start + piece.length]

    def add_to_grad_shard(self, reduced: torch.Tensor, unscale: float = 1.0) -> None:
        """Add a reduced chunk (the reducer's own buffer, free to take) times ``unscale`` (1/loss scale)."""
        if self.grad_shard is None:
            self.grad_shard = reduced if reduced.dtype == torch.float32 else reduced.float()
            if unscale != 1.0:
                self.grad_shard.mul_(unscale)
        else:
            self.grad_shard.add_(reduced, alpha=unscale)

    def release_grad_shard_if_unused(self) -> None:
        if all(p is None or p.grad is None for p in self.pieces):
            self.grad_shard = None


def _to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` that converts on the device: torch's own cross-device copy with a dtype change
    converts on the source side, which for a host source is a slow, synchronous CPU pass."""
    pinned = src.is_pinned()
    if src.device != dst.device and src.dtype != dst.dtype and src.device.type == "cpu":
        staged = torch.empty(src.shape, dtype=src.dtype, device=dst.device)
        staged.copy_(src, non_blocking=pinned)
        src, pinned = staged, False
    dst.copy_(src, non_blocking=pinned)  # a pinned host source: queued, not waited for
