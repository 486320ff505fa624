"""ZeroEngine: ZeRO for a module and its optimizers, usable from plain PyTorch.

    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=2), Comm.from_group(), device)
    loss = model(x).loss
    engine.begin_backward(loss)           # optional: lets the reducer read the graph first
    loss.backward()                       # hooks reduce-scatter gradients as they are ready
    engine.clip_grad_norm_(optimizer, 1.0)
    optimizer.step(); optimizer.zero_grad()   # routed through the engine

The stage is a policy read from the config's derived flags: stage 1 keeps full gradients
and reduces at the end of the accumulation window (``no_sync`` around the others), stage 2
reduces every micro-batch and keeps only the gradient shard, stage 3 also keeps only the
parameter shard between uses (see :mod:`lightning_zero.engine.gather`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

import torch
from torch import nn
from torch.profiler import record_function

from ..collectives import Comm
from ..config import DTYPE_NAMES, ZeroConfig
from ..partition import layout_unit, plan_buckets
from .activation import apply_activation_checkpointing
from .edits import EditWatch
from .flat_unit import FlatUnit, UnitState
from .gather import UNSCOPED_FORWARD, Gatherer
from .grads import GradientReducer, ReducePolicy
from .groups import build_needs, group_lookup, group_modules, members_of, owner_of
from .guard import install_load_into_masters, install_state_dict_guard, note_placeholder_use
from .host_schedule import HostSchedule
from .materialize import RngState, check_no_meta_left, has_meta, materialize_module, model_initializers
from .norms import any_nonfinite, by_device, global_norm, grad_norms
from .offload import Offloader
from .optim import Routes, check_optimizer, check_params, pieces_in_groups, unwrap
from .readiness import ForwardOrder
from .schedule_check import GatherScheduleCheck
from .supported import check_supported
from .torch_clip import install as install_torch_clip
from .weak import weakly

__all__ = ["ZeroEngine", "dtype_of"]

_live: weakref.WeakSet = weakref.WeakSet()  # engines whose hooks are installed (see ZeroEngine.owning)
log = logging.getLogger(__name__)


def dtype_of(name: Optional[str], default: torch.dtype) -> torch.dtype:
    return default if name is None else getattr(torch, DTYPE_NAMES[name])


class ZeroEngine:
    """Flattens, shards and steps ``module``'s parameters for ``optimizers``.

    Args:
        module: the model; its parameters become views into flat unit buffers.
        optimizers: the user's optimizers (kept, with the module's parameters in their groups).
        config: the ZeRO policy.
        comm: collectives over the data-parallel group.
        device: where buffers live.
        compute_dtype: dtype of parameters and gradients in the module (fp32, bf16, fp16).
        init_rng: random state captured when a meta-device model was created (stage 3 init).
        wrappers: wrappers of the optimizers (Lightning's LightningOptimizer); later ones are
            routed with :meth:`route_wrappers`.
        free_grads_at_step: free gradients at the step, where nothing reads them before the next
            ``zero_grad`` (see [Note: when gradients are freed]).
    """

    def __init__(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], config: ZeroConfig,
                 comm: Comm, device: torch.device, compute_dtype: torch.dtype = torch.float32,
                 init_rng: Optional[RngState] = None, wrappers: Sequence[Any] = (),
                 free_grads_at_step: bool = False) -> None:
        self.module = module
        self.optimizers = [unwrap(o) for o in optimizers]
        self.config = config
        self.comm = comm
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.reduce_dtype = dtype_of(config.reduce_dtype, compute_dtype)
        for optimizer in self.optimizers:
            check_optimizer(optimizer, config.allow_untested_optimizer)
        check_supported(module)
        apply_activation_checkpointing(module, config.activation_checkpointing)
        self.names = {id(p): n for n, p in module.named_parameters()}
        self._position = {id(p): i for i, (_, p) in enumerate(module.named_parameters())}
        self.group_modules = (group_modules(module, config.wrap_modules, config.min_group_params)
                              if config.shard_params else [])
        for k, optimizer in enumerate(self.optimizers):
            check_params(k, optimizer, self.names)
        self.units: list[FlatUnit] = []
        self._build_units(init_rng)
        self._prepare_buffers()
        self._slot = {id(p): (u, i) for u in self.units for i, p in enumerate(u.params)}
        # an offloaded step running during backward lists the pieces in the groups meanwhile (pieces_in_groups): a
        # reader of the groups then (the DeepSpeed-style engine's gradient norm) finds the slots through them
        self._piece_slot = {id(q): (u, i) for u in self.units for i, q in enumerate(u.pieces) if q is not None}
        self.offloader = (Offloader(self.units, config, self.device, compute_dtype, comm.rank, self.piece_of,
                                    self.unit_of) if config.offloads else None)
        self._grad_slots: list[set[int]] = [set() for _ in self.units]  # slots whose parameter holds a gradient
        self.window = 0  # windows closed so far (see engine.grads [Note: the window])
        self.grad_bytes_at_step = 0
        self.host_schedule = HostSchedule(self)  # when the host steps the offloaded units
        self.say: Callable[[str], None] = log.info  # where lines for the user go (the strategy: rank zero's log)
        self.ranks_on_node = 1  # the caller knows (host memory is shared by the node's ranks)
        self.gatherer = self._make_gatherer() if config.shard_params else None
        self._forward = ForwardOrder(module) if comm.world_size > 1 or comm.force else None
        policy = ReducePolicy(shard_grads=config.shard_grads, overlap=config.overlap_comm,
                              reduce_dtype=self.reduce_dtype,
                              accum_dtype=dtype_of(config.grad_accum_dtype, compute_dtype))
        self.reducer = GradientReducer(self.units, comm, policy, agree_order=self._agree_order,
                                       on_backward_end=self.gatherer.end_of_backward if self.gatherer else None,
                                       sink=self.offloader.take_reduced if self.offloader else None)
        # See [Note: when gradients are freed]; the Lightning strategy turns it on where it is exact.
        self.free_grads_at_step = free_grads_at_step
        self.routes = Routes()
        for optimizer in self.optimizers:
            self.routes.adopt(optimizer, self.optimizer_step, self.zero_grad, resolve=self._state_key)
        self.route_wrappers(wrappers)
        self.routes.route_module(module, self.zero_all_grads)
        self._sync_buffers_next = True  # see before_training_forward
        self.edit_watch = EditWatch(self.units)
        self._guards = install_state_dict_guard(module, self.units) if config.shard_params else []
        self._guards += install_load_into_masters(module, self.units)
        _live.add(self)
        install_torch_clip()  # torch's clip_grad_norm_ over this engine's parameters clips their shards

    @staticmethod
    def owning(param: torch.Tensor) -> Optional[ZeroEngine]:
        """The live engine that manages ``param`` (None: no engine does)."""
        return next((e for e in list(_live) if id(param) in e._slot), None)

    # ---- construction -------------------------------------------------------------------------
    def _plans(self) -> list[tuple[list[nn.Parameter], Optional[nn.Module]]]:
        """(parameters, group module or None): one entry per unit to build.

        Every floating-point parameter is flattened, trainable or not: frozen ones get the
        compute dtype and (stage 3) are sharded too, and a later unfreeze can train them. Frozen and
        trainable parameters go to different units: a unit is split evenly by elements, so a trainable
        head in one unit with a frozen backbone would put all of its gradients and optimizer state on
        the last rank (more than DDP's memory there, none on the others).
        """
        params = [p for _, p in self.module.named_parameters() if p.is_floating_point()]
        kinds = [[p for p in params if p.requires_grad], [p for p in params if not p.requires_grad]]
        if self.config.shard_params:
            owner = owner_of(self.module, self.group_modules)
            plans = [([p for p in kind if owner[id(p)] is g], g) for g in self.group_modules for kind in kinds]
            return [(mine, g) for mine, g in plans if mine]
        plans = []
        for kind in kinds:
            backward_order = kind[::-1]
            for bucket in plan_buckets([p.numel() for p in backward_order], self.config.reduce_bucket_size):
                members = sorted((backward_order[i] for i in bucket), key=lambda q: self._position[id(q)])
                plans.append((members, None))
        return plans

    def _build_units(self, init_rng: Optional[RngState]) -> None:
        plans = self._plans()
        if not has_meta(self.module):
            self.units = [self._build_unit(params) for params, _ in plans]
        else:
            self._materialize_and_build(plans, init_rng)
        # Default launch order = the order backward usually finishes units: the later a unit's first parameter,
        # the sooner. The reducer adopts rank 0's recorded forward order at the first backward.
        self.units.sort(key=lambda u: -min((self._position[id(p)] for p in u.params), default=-1))
        for index, unit in enumerate(self.units):
            unit.index = index

    def _materialize_and_build(self, plans: list[tuple], init_rng: Optional[RngState]) -> None:
        """Meta model: materialize module by module; shard each group as soon as it is complete."""
        modules = list(self.module.named_modules())
        home = group_lookup(self.module, self.group_modules if self.config.shard_params else [self.module])
        last = {id(home(name)): i for i, (name, _) in enumerate(modules)}  # where each group's modules end
        done_at: dict[int, list] = {}
        for params, group in plans:
            done_at.setdefault(last[id(group if group is not None else self.module)], []).append(params)
        saved = RngState()
        if init_rng is not None:
            init_rng.restore()
        remap: dict[int, nn.Parameter] = {}  # to_empty gives meta parameters new objects
        initializer = model_initializers(modules)
        try:
            for i, (name, module) in enumerate(modules):
                materialize_module(name, module, self.device, remap, initializer(name))
                for params in done_at.get(i, []):
                    current = [remap.get(id(p), p) for p in params]
                    for old, new in zip(params, current):
                        self.names[id(new)], self._position[id(new)] = self.names[id(old)], self._position[id(old)]
                    self.units.append(self._build_unit(current))
        finally:
            saved.restore()
        check_no_meta_left(self.module)
        for optimizer in self.optimizers:  # the optimizers were built on the meta parameters
            for group in optimizer.param_groups:
                group["params"] = [remap.get(id(p), p) for p in group["params"]]

    def _build_unit(self, params: list[nn.Parameter]) -> FlatUnit:
        unit = FlatUnit(index=-1, params=params, names=[self.names[id(p)] for p in params],
                        layout=layout_unit([p.numel() for p in params], self.comm.world_size),
                        rank=self.comm.rank, compute_dtype=self.compute_dtype, shapes=[p.shape for p in params])
        staging = torch.zeros(unit.layout.padded_numel, dtype=torch.float32, device=self.device)
        for slot, p in zip(unit.layout.slots, params):
            staging[slot.offset:slot.end].copy_(p.detach().reshape(-1))
        self.comm.broadcast(staging, src=0)  # every rank starts from rank 0's values, as DDP does
        unit.build(staging, keep_full=not self.config.shard_params,
                   placeholder_ids=[self._position[id(p)] for p in params])
        return unit

    def _make_gatherer(self) -> Gatherer:
        unit_of = {id(p): u for u in self.units for p in u.params}
        small = {u.index for u in self.units if u.layout.numel < self.config.param_persistence_threshold}
        gatherer = Gatherer(build_needs(self.module, self.group_modules, unit_of), self.comm.sibling(), self.config.prefetch,
                        small, members_of(self.module, self.group_modules),
                        copy_stream=self.offloader.copy_stream if self.offloader is not None else None,
                        # nothing to compare when every unit stays gathered (no forward gathers)
                        schedule=(GatherScheduleCheck(self.comm, self.device, [u.names[0] for u in self.units])
                                  if len(small) < len(self.units) else None),
                        on_unscoped_forward=weakly(self._meet_for_forward))  # weakly: no cycle through the hooks
        gatherer.on_forward_edit = weakly(self._take_forward_edits)
        return gatherer

    def _take_forward_edits(self, unit: FlatUnit) -> None:
        self.edit_watch.absorb_unit(unit, self._host_indices(), self._host_edits_reachable())

    def _meet_for_forward(self) -> None:
        self.comm.rendezvous(UNSCOPED_FORWARD, self.config.rendezvous_timeout_s)

    def forward_scope(self) -> Any:
        """A forward every rank runs (the DeepSpeed-style engine's): stage 3 checks the ranks' gathers instead of
        meeting first (see gather.py, [Note: forwards outside a step])."""
        return self.gatherer.scope() if self.gatherer is not None else nullcontext()

    def check_gather_schedule(self, wait: bool = False) -> None:
        """Stage 3: did every rank gather the same units? (:mod:`lightning_zero.engine.schedule_check`)."""
        if self.gatherer is not None:
            self.gatherer.check_schedule(wait)

    def _agree_order(self) -> Optional[list[int]]:
        """Rank 0's forward order becomes every rank's launch order (one broadcast, first backward)."""
        if self._forward is None:
            return None
        order = self._forward.unit_order([u.params for u in self.units])
        self._forward.remove()
        agreed = self.comm.broadcast(torch.tensor(order, dtype=torch.int64, device=self.device), src=0)
        return agreed.tolist()

    def before_training_forward(self) -> None:
        """DDP's buffer rule: rank 0's buffers go to every rank before a forward that follows a forward
        which synchronized gradients (the first micro-batch of each accumulation window)."""
        if self.gatherer is not None:  # stage 3 gathers from the masters next: edits made since must be there
            self.absorb_edits(offloaded_too=False, marked=True)
        else:
            self.edit_watch.take_replaced(self._host_indices(), self._host_edits_reachable())
        if self.config.broadcast_buffers and self._sync_buffers_next:
            self.broadcast_buffers()
        self._sync_buffers_next = torch.is_grad_enabled() and self.last_micro_batch

    def before_eval_forward(self) -> None:
        """A fit's validation forward: DDP's forward broadcasts rank 0's buffers here too when the training forward
        before it synchronized gradients (BatchNorm's running statistics then validate alike on every rank)."""
        if self.config.broadcast_buffers and self._sync_buffers_next:
            self.broadcast_buffers()
        self._sync_buffers_next = False

    @contextmanager
    def hold(self, group: nn.Module, until_backward_end: bool) -> Iterator[None]:
        """Stage 3: keep ``group``'s parameters gathered for a scope (the root module for a Lightning step);
        with ``until_backward_end`` until the backward that follows has finished. Elsewhere a no-op."""
        if self.gatherer is None:
            yield
            return
        with self.gatherer.hold(group, until_backward_end):
            try:
                yield
            except RuntimeError as err:
                self.explain_placeholder_use(err)
                raise

    def explain_placeholder_use(self, err: RuntimeError, only_sharded: bool = True) -> None:
        """A shape error on a parameter used outside its group's forward names it (``only_sharded=False``: an
        error in backward, whose saved placeholder's unit may be gathered again by then)."""
        note_placeholder_use(err, self.units, self._position, self.names, only_sharded)

    def describe_offload(self) -> Optional[str]:
        """One line on what is offloaded where (None without offload)."""
        if self.offloader is None:
            return None
        return self.offloader.describe(sum(u.layout.shard_numel for u in self.units))

    def end_gather_group(self) -> None:
        """Destroy the process group stage 3 gathers on (``Comm.sibling``: one per engine). Its gloo threads live as
        long as the group object: each fit/validate/test would leave one behind, the last torn down only during
        interpreter finalization ([Note: destroy the group at exit] in :mod:`lightning_zero.process_group`). Not a
        collective: every rank's gathers were waited before."""
        gatherer = self.gatherer
        if gatherer is None or gatherer.comm.group is None or gatherer.comm.group is self.comm.group:
            return
        group = gatherer.comm.group
        gatherer.comm = self.comm  # the released engine gathers no more
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group(group)

    def close(self) -> None:
        """Release what outlives a run: the stage-3 gather group, offload threads and NVMe files."""
        self.end_gather_group()
        if self.offloader is not None:
            self.offloader.close()

    def free(self) -> None:
        """After ``unflatten`` and ``close``, before another engine is built beside it (zero_auto's move): drop
        every tensor this engine holds, so that whatever still references it holds no memory. An autograd graph
        the user (or Lightning) keeps, and the optimizers the run was given, can outlive the engine; the
        engine's own reference cycles wait for the cycle collector."""
        for optimizer in self.optimizers:
            for unit in self.units:
                for piece in unit.pieces:
                    optimizer.state.pop(piece, None)
        for unit in self.units:
            unit.forget()
        self.units, self.offloader, self.reducer, self.gatherer = [], None, None, None

    def held_host_bytes(self) -> int:
        """Host bytes of the offloaded units' masters, gradient arena and optimizer state: what ``free`` gives
        back (zero_auto plans a move with them counted as free)."""
        from .memory import offloaded_bytes

        return offloaded_bytes(self).get("host", 0)

    @torch.no_grad()
    def broadcast_buffers(self) -> None:
        """Rank 0's buffers on every rank (DDP's ``broadcast_buffers``), one flat collective per dtype."""
        if self.comm.world_size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self.module.buffers():
            by_dtype.setdefault(b.dtype, []).append(b)
        for buffers in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            self.comm.broadcast(flat, src=0)
            torch._foreach_copy_(buffers, [v.view_as(b) for v, b in zip(flat.split([b.numel() for b in buffers]),
                                                                          buffers)])

    @torch.no_grad()
    def _prepare_buffers(self) -> None:
        """Buffers keep their dtype (BatchNorm statistics stay fp32) and take rank 0's values."""
        for _, b in self.module.named_buffers():
            b.data = self.comm.broadcast(b.detach().to(self.device).contiguous(), src=0)

    def overlap_step(self, optimizer: Optional[torch.optim.Optimizer], blocker: Optional[str] = None,
                     speculate: Optional[str] = None) -> str:
        """When the host steps ``optimizer``'s offloaded units (see HostSchedule.set); the line to tell the user."""
        return self.host_schedule.set(optimizer, blocker, speculate)

    def speculation_blocker(self, optimizers: list[Any], ranks_on_node: int) -> Optional[str]:
        """Why the host step may not speculate here, or None (a collective; see HostSchedule.blocker)."""
        return self.host_schedule.blocker(optimizers, ranks_on_node)

    @property
    def speculation_decision(self) -> str:
        return self.host_schedule.decision

    # ---- backward -------------------------------------------------------------------------------
    def begin_backward(self, loss: torch.Tensor) -> None:
        """Call before ``loss.backward()``: the reducer reads which gradients will arrive off the graph."""
        if self._host_edits_reachable():
            # an offloaded master may step on the host during this backward: edits made since the last step (a WGAN's
            # clamp, in training_step or after the previous step) must be in it first
            self.absorb_edits(offloaded_too=False, marked=True)
        self.reducer.begin_backward([loss])
        self.host_schedule.backward_started()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.begin_backward(loss)
        loss.backward(**kwargs)
        self.end_backward()

    def end_backward(self) -> None:
        """Call after a backward started with ``begin_backward``: if it reached none of this rank's
        parameters (no hook fired), the reductions every other rank issues are issued here too."""
        if self.reducer.in_backward:
            self.reducer.finish_backward()
        self.host_schedule.backward_ended()

    @property
    def last_micro_batch(self) -> bool:
        """False inside ``no_sync`` (a micro-batch before the last of a window)."""
        return self.reducer.last_micro_batch

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches before the last of a window: stage 1 accumulates locally instead of reducing."""
        with self.reducer.no_sync():
            yield

    # ---- gradients of a window --------------------------------------------------------------------
    def finish_grads(self) -> None:
        """Close the window: wait for the reductions, agree on the parameters any rank used (one
        collective), and give those parameters' pieces their gradient. A no-op when closed."""
        used = self.reducer.close_window()
        if used is None:
            return
        if self.offloader is not None:
            self.offloader.finish_window()  # the host reads the offloaded gradients from here on
        for unit in self.units:
            for slot in used[unit.index]:
                self._grad_slots[unit.index].add(slot)
                unit.give_grad(slot)
            unit.release_grad_shard_if_unused()
        self.window += 1

    def slots_of(self, optimizer: torch.optim.Optimizer) -> list[tuple[FlatUnit, int]]:
        out = []
        for g, group in enumerate(unwrap(optimizer).param_groups):
            for p in group["params"]:
                found = self._slot.get(id(p)) or self._piece_slot.get(id(p))
                if found is None:
                    raise ValueError(
                        f"{type(unwrap(optimizer)).__name__} param group {g} holds a tensor of shape "
                        f"{tuple(p.shape)} that is not a parameter lightning_zero manages (added after setup?). "
                        f"Add the model's own parameters only (optimizer.add_param_group with module.parameters()).")
                out.append(found)
        return out

    def _state_key(self, key: Any) -> tuple[bool, Any]:
        """``optimizer.state`` by module parameter: (managed, this rank's piece); see [Note: state by parameter]."""
        found = self._slot.get(id(key))
        if found is None or found[0].params[found[1]] is not key:
            return False, None
        unit, slot = found
        if unit.index in self._host_indices():
            if self.config.offload_optimizer == "nvme":
                raise RuntimeError(
                    f"optimizer.state[{unit.names[slot]!r}]: with offload_optimizer='nvme' the optimizer state lives "
                    f"in files that the step reads and writes; it cannot be read or changed by the parameter. Change "
                    f"it through a checkpoint, or offload to 'cpu'.")
            if self.config.delayed_step:
                self.settle(publish=False)  # the host's running update owns the state until it is done
        return True, unit.pieces[slot]

    def slot_of(self, param: nn.Parameter) -> tuple[FlatUnit, int]:
        """The unit holding ``param`` and its slot there."""
        return self._slot[id(param)]

    def unit_of(self, param: nn.Parameter) -> FlatUnit:
        return self._slot[id(param)][0]

    def piece_of(self, param: nn.Parameter) -> Optional[nn.Parameter]:
        unit, slot = self._slot[id(param)]
        return unit.pieces[slot]

    def grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """This rank's fp32 gradient pieces of ``optimizer``'s parameters (closes the window first)."""
        self.finish_grads()
        pieces = (u.pieces[s] for u, s in self.slots_of(optimizer))
        return [p.grad for p in pieces if p is not None and p.grad is not None]

    def set_grad_scale(self, scale: float) -> None:
        """The coming backward's gradients are scaled by ``scale`` (fp16 loss scaling): they are stored
        divided by it (see :mod:`lightning_zero.precision.step`)."""
        self.reducer.set_grad_scale(scale)

    @torch.no_grad()
    def grads_nonfinite(self, optimizer: torch.optim.Optimizer) -> bool:
        """True if any rank holds an inf/nan gradient of ``optimizer``'s parameters (one all-reduce)."""
        return any_nonfinite(self.grads(optimizer), self.device, self.comm)

    def grads_of(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's fp32 gradient pieces of those of ``params`` this engine holds (closes the window first)."""
        self.finish_grads()
        pieces = (self.piece_of(p) for p in params if id(p) in self._slot)
        return [p.grad for p in pieces if p is not None and p.grad is not None]

    @torch.no_grad()
    def grad_norm(self, optimizer: Optional[torch.optim.Optimizer], norm_type: float = 2.0,
                  grads: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
        """Global gradient norm of ``optimizer``'s parameters (or of ``grads``, pieces) over every rank's pieces."""
        return global_norm(self.grads(optimizer) if grads is None else grads, norm_type, self.device, self.comm)

    @torch.no_grad()
    def clip_grad_norm_(self, optimizer: Optional[torch.optim.Optimizer], max_norm: float, norm_type: float = 2.0,
                        grads: Optional[list[torch.Tensor]] = None,
                        total: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Like ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters (or ``grads``, pieces), across
        shards; ``total``: the norm to clip by, when it spans more than these (see torch_clip.py)."""
        grads = self.grads(optimizer) if grads is None else grads
        total = self.grad_norm(None, norm_type, grads) if total is None else total
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        groups = by_device(grads)
        on_host = self.device.type != "cpu" and any(device.type == "cpu" for device in groups)
        if (self.host_schedule.speculating or on_host) and coef.item() == 1.0:
            # multiplying by one changes no value: the early steps stand, and the offloaded gradients are not
            # read and written once more by the host for nothing (the GPU-only path keeps torch's sync-free rule)
            return total
        if self.host_schedule.speculating:
            self.offloader.reject_speculation()  # before the multiply: the worker may still read them
        for device, grads in groups.items():
            torch._foreach_mul_(grads, coef.to(device))
        return total

    @torch.no_grad()
    def clip_grad_value_(self, optimizer: Optional[torch.optim.Optimizer], clip_value: float,
                         grads: Optional[list[torch.Tensor]] = None) -> None:
        grads = self.grads(optimizer) if grads is None else grads
        if self.host_schedule.speculating:  # undo the early steps of the units whose gradients the clamp changes
            self.offloader.reject_speculation([u for u in self.offloader.speculated() if u.grad_shard is not None
                                               and bool(u.grad_shard.abs().amax() > clip_value)])
        for g in grads:
            g.clamp_(-clip_value, clip_value)

    def nonfinite_parameters(self) -> list[str]:
        """Names of parameters whose gradient holds inf/nan on any rank (diagnostics)."""
        bad = {u.names[i] for u in self.units for i, p in enumerate(u.pieces)
               if p is not None and p.grad is not None and not torch.isfinite(p.grad).all()}
        return sorted(set().union(*self.comm.all_gather_object(sorted(bad))))

    # ---- the step ------------------------------------------------------------------------------------
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Optional[Callable] = None,
                       **kwargs: Any) -> Any:
        """What the adopted ``optimizer.step(closure)`` runs: closure, window, step, publish."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        out = self.step(optimizer, **kwargs)
        return loss if loss is not None else out

    # [Note: when gradients are freed]
    # Under DDP a parameter's gradient lives from the backward that writes it until the owning
    # optimizer's ``zero_grad()`` (or ``module.zero_grad()``) clears it: a step does not clear it, and
    # every backward in between adds to it (a GAN's generator loss writes into the discriminator's
    # gradients, which the discriminator's ``zero_grad()`` later drops). The engine keeps exactly that.
    # Kept from a step to the next ``zero_grad``, the fp32 gradient shard would sit through the next
    # forward, so where nothing can read or add to it in between, ``free_grads_at_step`` frees it at
    # the step: Lightning's automatic optimization with the stock ``optimizer_zero_grad`` (its next
    # ``zero_grad`` comes before any backward), and DeepSpeed's engine API (whose step clears them).
    def step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        """Step ``optimizer`` on this rank's pieces, then publish the new values (stages 1/2)."""
        optimizer = unwrap(optimizer)
        self.settle(in_step=True)
        self.finish_grads()
        inner = self.routes.inner_step(optimizer)
        self.grad_bytes_at_step = sum(u.grad_shard.numel() * 4 for u in self.units if u.grad_shard is not None)
        published: set[int] = set()
        early: set[int] = set()  # units stepped during backward: their own chunk went up then
        if self.offloader is not None:
            def publish(units: list[FlatUnit]) -> None:
                self.republish(units)
                published.update(u.index for u in units)

            with torch.no_grad():
                early = self.offloader.overlap.stepped if self.offloader.overlap is not None else set()
                out = self.offloader.step(optimizer, lambda: inner(**kwargs), publish, self._stepped_everywhere,
                                          self._on_every_rank)
                published.update(u.index for u in self.offloader.in_flight)  # published once the update is done
        else:
            with torch.no_grad(), pieces_in_groups(optimizer, self.piece_of):
                out = inner(**kwargs)
        # read the groups only now: until the offloader's step has drained it, the overlap worker may be
        # stepping (with this rank's pieces in the groups) on its thread
        stepped = self._units_with_grads(optimizer)
        self.republish([u for u in stepped if u.index not in published], fresh=frozenset(early - published))
        self._update_aliases([u for u in stepped if u.aliases])
        self.edit_watch.mark_published(self._host_indices(), self._host_edits_reachable())
        if self.free_grads_at_step:
            self._drop_grads(self.slots_of(optimizer))
        self.host_schedule.step_ended()
        return out

    def settle(self, publish: bool = True, in_step: bool = False) -> None:
        """``delayed_step``: wait for the host update still running; ``publish`` (a collective) its values to the
        device. Before reading or writing the fp32 state (checkpoints), evaluation and the end of fit. First,
        edits a user made to the parameters since they were published go into the masters (``in_step``: not the
        offloaded ones, which the host may be stepping)."""
        # in the step an offloaded master may have been stepped during backward already: only through the fingerprints
        # and only when no worker steps during backward
        self.absorb_edits(offloaded_too=not in_step,
                          marked=in_step and self.offloader is not None and self.offloader.overlap is None)
        if self.offloader is not None:
            self.offloader.settle(self.republish if publish else None)

    def absorb_edits(self, offloaded_too: bool = True, marked: bool = False) -> None:
        """A user's in-place edits of the parameters go into the fp32 masters (:class:`.edits.EditWatch`)."""
        self.edit_watch.absorb(self._host_indices(), self._host_edits_reachable(), offloaded_too, marked)

    def _host_indices(self) -> Collection[int]:
        return self.offloader.indices if self.offloader is not None else ()

    def _host_edits_reachable(self) -> bool:
        return self.offloader is not None and self.config.offload_optimizer != "nvme" and not self.config.delayed_step

    def grad_norms(self, norm_type: float) -> dict[str, torch.Tensor]:
        """Each parameter's gradient p-norm over every rank's piece, by name, for the parameters that hold a
        gradient (:mod:`lightning_zero.engine.norms`). A collective."""
        self.finish_grads()
        slots = [(u, s) for u in self.units for s in sorted(self._grad_slots[u.index])]
        return grad_norms(slots, self.device, self.comm, norm_type)

    def _everywhere(self, flags: list[bool]) -> list[bool]:
        """Each flag true on every rank (one all-reduce; the same list length on every rank)."""
        if self.comm.world_size == 1 or not flags:
            return flags
        false_somewhere = torch.tensor([0.0 if f else 1.0 for f in flags], device=self.device)
        self.comm.all_reduce(false_somewhere, op="max")
        return [w == 0.0 for w in false_somewhere.tolist()]

    def _on_every_rank(self, flag: bool) -> bool:
        return self._everywhere([flag])[0]

    def _stepped_everywhere(self, early: set[int], units: list[FlatUnit]) -> set[int]:
        """Of ``units`` (the same list on every rank), those every rank stepped during backward."""
        return {u.index for u, done in zip(units, self._everywhere([u.index in early for u in units])) if done}

    def skip_step(self, optimizer: torch.optim.Optimizer) -> None:
        """No step for ``optimizer`` this window (fp16 overflow): values and state unchanged."""
        self.settle(in_step=True)
        self.finish_grads()
        if self.host_schedule.speculating:  # units stepped during backward get their values back, on the device too
            self.offloader.reject_speculation()
            self.offloader.overlap.drain()
            self.republish(self.offloader.units_of(optimizer))
        if self.free_grads_at_step:
            self._drop_grads(self.slots_of(optimizer))
        self.host_schedule.step_ended()

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()``: forget the gradients of its parameters (closes an open window)."""
        self.finish_grads()
        self._drop_grads(self.slots_of(optimizer))

    def zero_all_grads(self) -> None:
        """``module.zero_grad()``: forget every gradient, whichever optimizer (or none) owns it."""
        self.finish_grads()
        self._drop_grads([(u, slot) for u in self.units for slot in range(len(u.params))])

    def _units_with_grads(self, optimizer: torch.optim.Optimizer) -> list[FlatUnit]:
        """Units holding a gradient of ``optimizer``'s parameters on some rank (the ones a step changes)."""
        found = {u.index: u for u, slot in self.slots_of(optimizer) if slot in self._grad_slots[u.index]}
        return [found[k] for k in sorted(found)]

    @torch.no_grad()
    def _drop_grads(self, slots: Iterable[tuple[FlatUnit, int]]) -> None:
        touched: dict[int, FlatUnit] = {}
        dropped: dict[int, list[torch.Tensor]] = {}
        for unit, slot in slots:
            if slot in self._grad_slots[unit.index]:  # the same on every rank: a global flag
                self._grad_slots[unit.index].discard(slot)
                touched[unit.index] = unit
                grad = unit.drop_grad(slot)
                if grad is not None:
                    dropped.setdefault(unit.index, []).append(grad)
        for k, unit in touched.items():
            unit.release_grad_shard_if_unused()
            if unit.grad_shard is not None and dropped.get(k):  # it lives on for another optimizer's: clear ours
                torch._foreach_zero_(dropped[k])

    @torch.no_grad()
    def republish(self, units: Optional[Iterable[FlatUnit]] = None, fresh: frozenset[int] = frozenset()) -> None:
        """Refresh the full values of gathered units from their (new) master shards.

        Stages 1/2 keep every unit gathered; stage 3 refreshes the ones gathered now (persistent
        small units, a held root). The others are gathered from the new shards at their next use.
        Units in ``fresh`` (indices) already hold their own chunk of the new values on the device
        (:meth:`FlatUnit.publish_own`): only the other ranks' chunks are missing (none on one rank).
        """
        units = self.units if units is None else list(units)
        for unit in units:
            if unit.index not in fresh:
                unit.refresh_param_shard()
        stale = [u for u in units if u.state is UnitState.UNSHARDED and not (self.comm.world_size == 1 and u.index in fresh)]
        with record_function("zero/republish"):
            self._all_gather_units(stale, fresh)

    @torch.no_grad()
    def _update_aliases(self, units: list[FlatUnit]) -> None:
        """Tensors a user gave parameters (``p.data = t``) follow the new values, as under DDP, where ``t`` became the
        parameter (see [Note: replaced parameter data]): the fp32 masters, gathered (a collective)."""
        for unit, full in self.gather_masters(units):
            views = unit.param_views(full)
            for slot, alias in unit.aliases.items():
                alias.copy_(views[slot])

    def _all_gather_units(self, stale: list[FlatUnit], fresh: frozenset[int] = frozenset()) -> None:
        handles = [self.comm.all_gather(u.full, u.own_chunk() if u.index in fresh else u.gather_source(), async_op=True)
                   for u in stale]
        for handle in handles:
            handle.wait()

    def adopt_optimizers(self, optimizers: Sequence[Any]) -> list[torch.optim.Optimizer]:
        """The run's optimizers were set again during fit (a callback's ``trainer.strategy.setup_optimizers``,
        switching AdamW for SGD): new ones are checked and routed (their state starts empty, as a new optimizer's
        under DDP; one set back keeps the state it made here), ones no longer listed get their own methods back.
        With offload the host then steps after backward (the overlap was set up for the old optimizer). Returns
        the new ones."""
        current = [unwrap(o) for o in optimizers]
        known, listed = {id(o) for o in self.optimizers}, {id(o) for o in current}
        new = [o for o in current if id(o) not in known]
        gone = [o for o in self.optimizers if id(o) not in listed]
        for k, optimizer in enumerate(current):
            if id(optimizer) not in known:
                check_optimizer(optimizer, self.config.allow_untested_optimizer)
                check_params(k, optimizer, self.names)
        for optimizer in gone:
            self.routes.release_optimizer(optimizer)
        for optimizer in new:
            self.routes.adopt(optimizer, self.optimizer_step, self.zero_grad, pieces=self._piece_slot,
                              resolve=self._state_key)
        self.optimizers = current
        if new and self.offloader is not None:
            self.host_schedule.trial = None  # a speculation trial timed the old optimizer: it must not set it again
            self.say(self.overlap_step(None, "optimizers set again during fit"))
        return new

    def route_wrappers(self, wrappers: Iterable[Any]) -> None:
        """Route new wrappers of the optimizers (Lightning re-wraps whenever its optimizer list is set)."""
        for wrapper in wrappers:
            self.routes.route_wrapper(wrapper)

    # ---- teardown -------------------------------------------------------------------------------------
    @torch.no_grad()
    def unflatten(self, device: Optional[torch.device] = None) -> None:
        """Give the module back as plain fp32 parameters holding the trained (master) values."""
        self.settle(publish=False)
        self.detach()
        for unit, full in self.gather_masters():
            unit.give_params(full, device or self.device, copy=True)

    @torch.no_grad()
    def park(self) -> None:
        """After fit (stages 1/2): the module gets its trained fp32 parameters back, full on every rank as
        under DDP; the engine keeps only this rank's fp32 master shard, moved to host memory, and the
        optimizer state, so that a checkpoint can still be saved.

        With fp32 compute the module's parameters already hold the master values: nothing is gathered
        (Lightning's teardown then copies them to the CPU). With bf16/fp16 compute the fp32 masters are
        gathered one unit at a time straight into host memory, so no device holds the fp32 model.
        """
        self.settle()
        self.detach()
        if self.compute_dtype != torch.float32:
            for unit, full in self.gather_masters():
                unit.give_params(full, torch.device("cpu"), copy=True)
        for unit in self.units:
            unit.park()

    @torch.no_grad()
    def compute_in_fp32(self) -> None:
        """After a stage-3 fit in mixed precision: the module's parameters are fp32 again, as DDP's are (the
        persistent units hold their masters' values, every gather outside the trainer gives fp32), so user code
        after fit reads and runs the trained fp32 model. A collective. NVMe masters stay as they are."""
        if self.gatherer is None or self.compute_dtype == torch.float32 or self.config.offload_optimizer == "nvme":
            return
        self.settle()
        self.gatherer.gather_in(torch.float32)

    def drop_full(self) -> None:
        """Forget the flat compute buffers once the module holds its parameters elsewhere (after park)."""
        for unit in self.units:
            unit.drop_full()

    def restore_param_views(self) -> None:
        """Point parameters at the engine's buffers again after something replaced their ``.data``
        (Lightning's teardown moves the module to the CPU; evaluation after fit moves it back). Data a user gave
        parameters after fit (``p.data = t``) is taken first, as DDP's module would evaluate with it."""
        self.edit_watch.take_replaced(self._host_indices(), self._host_edits_reachable())
        for unit in self.units:
            unit.restore_params()

    def detach(self, wait: bool = True) -> None:
        """Remove every hook and give the optimizers their own methods back.

        ``wait=False`` after an error: reductions still in flight are dropped, not waited for (their
        peers may never join them), so that no rank blocks on its way out.
        """
        for handle in self._guards:
            handle.remove()
        self._guards = []
        if wait:
            self.reducer.wait_all()
        else:
            self.reducer.abandon()
        self.reducer.remove_hooks()
        if self.gatherer is not None:
            self.gatherer.remove_hooks()
        if self._forward is not None:
            self._forward.remove()
        self.routes.release()
        _live.discard(self)

    def gather_masters(self, units: Optional[Iterable[FlatUnit]] = None) -> Iterable[tuple[FlatUnit, torch.Tensor]]:
        """Yield each unit (default: all) with its full fp32 values (one unit's full buffer alive at a time)."""
        for unit in self.units if units is None else units:
            full = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=self.device)
            self.comm.all_gather(full, unit.master.detach().to(self.device), async_op=False)
            yield unit, full
