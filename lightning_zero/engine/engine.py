"""ZeroEngine: ZeRO for a module and its optimizers, usable from plain PyTorch.

    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=2), Comm.from_group(), device)
    loss.backward()                       # hooks reduce-scatter gradients as they are ready
    engine.clip_grad_norm_(optimizer, 1.0)
    optimizer.step(); engine.after_step(optimizer); optimizer.zero_grad()

The stage is a policy read from the config's derived flags: stage 1 keeps full gradients
and reduces at the end of the accumulation window, stage 2 reduces every micro-batch and
keeps only the gradient shard, stage 3 also keeps only the parameter shard between uses
(see :mod:`lightning_zero.engine.gather`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Optional, Union

import torch
from torch import nn

from ..collectives import Comm
from ..config import DTYPE_NAMES, ZeroConfig
from ..partition import layout_unit, plan_buckets
from .activation import apply_activation_checkpointing
from .flat_unit import FlatUnit, UnitState
from .gather import Gatherer, build_needs, group_lookup, group_modules, members_of, owner_of
from .grads import GradientReducer
from .materialize import RngState, check_no_meta_left, has_meta, materialize_module
from .optim import check_optimizer, point_at_masters

__all__ = ["ZeroEngine", "dtype_of"]


def dtype_of(name: Optional[str], default: torch.dtype) -> torch.dtype:
    return default if name is None else getattr(torch, DTYPE_NAMES[name])


class ZeroEngine:
    """Flattens, shards and steps ``module``'s parameters owned by ``optimizers``.

    Args:
        module: the model; its parameters become views into flat unit buffers.
        optimizers: the user's optimizers (kept; their param groups are re-pointed).
        config: the ZeRO policy.
        comm: collectives over the data-parallel group.
        device: where buffers live.
        compute_dtype: dtype of parameters and gradients in the module (fp32, bf16, fp16).
        init_rng: random state captured when a meta-device model was created (stage 3 init).
    """

    def __init__(self, module: nn.Module, optimizers: list[torch.optim.Optimizer], config: ZeroConfig,
                 comm: Comm, device: torch.device, compute_dtype: torch.dtype = torch.float32,
                 init_rng: Optional[RngState] = None) -> None:
        self.module = module
        self.optimizers = list(optimizers)
        self.config = config
        self.comm = comm
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.reduce_dtype = dtype_of(config.reduce_dtype, compute_dtype)
        for optimizer in self.optimizers:
            check_optimizer(optimizer, config.allow_untested_optimizer)
        apply_activation_checkpointing(module, config.activation_checkpointing)
        self.names = {id(p): n for n, p in module.named_parameters()}
        self._position = {id(p): i for i, (_, p) in enumerate(module.named_parameters())}
        self.units: list[FlatUnit] = []
        self.grad_bytes_at_step: dict[int, int] = {}  # id(optimizer) -> fp32 gradient-shard bytes it stepped
        self.units_of: dict[int, list[FlatUnit]] = {}  # id(optimizer) -> its units
        self.group_modules = (group_modules(module, config.wrap_modules, config.min_group_params)
                              if config.shard_params else [])
        groups = self._param_groups()  # validates the optimizers' parameters first
        # the user's parameter order per (optimizer, group): checkpoints list names in it, so a
        # plain (non-ZeRO) optimizer can load them by position
        self.group_names: dict[tuple[int, int], list[str]] = {
            (k, g): [self.names[id(p)] for p in group["params"]]
            for k, optimizer in enumerate(self.optimizers) for g, group in enumerate(optimizer.param_groups)}
        self._build_units(groups, init_rng)
        self._prepare_buffers()
        for k, optimizer in enumerate(self.optimizers):
            masters = [[u.master for u in self.units if u.group_index == (k, g)]
                       for g in range(len(optimizer.param_groups))]
            point_at_masters(optimizer, masters)
            self.units_of[id(optimizer)] = [u for u in self.units if u.group_index[0] == k]
        self.gatherer: Optional[Gatherer] = None
        if config.shard_params:
            unit_of = {id(p): u for u in self.units for p in u.params}
            small = {u.index for u in self.units if u.layout.numel < config.param_persistence_threshold}
            self.gatherer = Gatherer(build_needs(module, self.group_modules, unit_of), module, comm,
                                     config.prefetch, small, members_of(module, self.group_modules))
            for unit in self.units:
                if unit.index in small:
                    self.gatherer.unshard(unit)
        self.reducer = GradientReducer(self.units, comm, config.shard_grads, config.overlap_comm,
                                       on_unit_reduced=self.gatherer.on_unit_reduced if self.gatherer else None,
                                       on_backward_end=self.gatherer.end_of_backward if self.gatherer else None)

    # ---- construction -------------------------------------------------------------
    def _param_groups(self) -> list[tuple[tuple[int, int], list[nn.Parameter]]]:
        seen: dict[int, str] = {}
        groups = []
        for k, optimizer in enumerate(self.optimizers):
            for g, group in enumerate(optimizer.param_groups):
                params = []
                for p in group["params"]:
                    if id(p) not in self.names:
                        raise ValueError(
                            f"Optimizer {k} ({type(optimizer).__name__}) param group {g} holds a tensor of shape "
                            f"{tuple(p.shape)} that is not a parameter of the model. lightning_zero can only "
                            f"shard the model's own parameters: pass self.parameters() (or a subset) to it.")
                    if id(p) in seen:
                        raise ValueError(
                            f"Parameter '{self.names[id(p)]}' appears in two optimizer param groups "
                            f"({seen[id(p)]} and optimizer {k} group {g}); each parameter can belong to one only.")
                    seen[id(p)] = f"optimizer {k} group {g}"
                    params.append(p)
                groups.append(((k, g), sorted(params, key=lambda q: self._position[id(q)])))
        # Parameters no optimizer steps (frozen ones, or all of them when evaluating) are still
        # flattened: they get the compute dtype, stage 3 shards them, and teardown restores fp32 exactly.
        rest = [p for _, p in self.module.named_parameters() if id(p) not in seen and p.is_floating_point()]
        if rest:
            groups.append(((-1, 0), rest))
        return groups

    def _plans(self, groups: list[tuple[tuple[int, int], list[nn.Parameter]]]) -> list[tuple]:
        """(param group key, parameters, group module or None): one entry per unit to build."""
        plans = []
        if self.config.shard_params:
            owner = owner_of(self.module, self.group_modules)
            for key, params in groups:
                for g in self.group_modules:
                    mine = [p for p in params if owner[id(p)] is g]
                    if mine:
                        plans.append((key, mine, g))
            return plans
        for key, params in groups:
            backward_order = params[::-1]
            for bucket in plan_buckets([p.numel() for p in backward_order], self.config.reduce_bucket_size):
                members = sorted((backward_order[i] for i in bucket), key=lambda q: self._position[id(q)])
                plans.append((key, members, None))
        return plans

    def _build_units(self, groups: list[tuple[tuple[int, int], list[nn.Parameter]]],
                     init_rng: Optional[RngState]) -> None:
        plans = self._plans(groups)
        meta = has_meta(self.module)
        if not meta:
            self.units = [self._build_unit(key, params) for key, params, _ in plans]
        else:
            self._materialize_and_build(plans, init_rng)
        # Launch order = the order backward finishes units: the later a unit's first parameter, the sooner.
        self.units.sort(key=lambda u: -min((self._position[id(p)] for p in u.params), default=-1))
        for index, unit in enumerate(self.units):
            unit.index = index

    def _materialize_and_build(self, plans: list[tuple], init_rng: Optional[RngState]) -> None:
        """Meta model: materialize module by module; shard each group as soon as it is complete."""
        modules = list(self.module.named_modules())
        home = group_lookup(self.module, self.group_modules if self.config.shard_params else [self.module])
        last = {id(home(name)): i for i, (name, _) in enumerate(modules)}  # where each group's modules end
        done_at: dict[int, list] = {}
        for key, params, group in plans:
            done_at.setdefault(last[id(group if group is not None else self.module)], []).append((key, params))
        saved = RngState()
        if init_rng is not None:
            init_rng.restore()
        remap: dict[int, nn.Parameter] = {}  # to_empty gives meta parameters new objects
        try:
            for i, (name, module) in enumerate(modules):
                materialize_module(name, module, self.device, remap)
                for key, params in done_at.get(i, []):
                    current = [remap.get(id(p), p) for p in params]
                    for old, new in zip(params, current):
                        self.names[id(new)], self._position[id(new)] = self.names[id(old)], self._position[id(old)]
                    self.units.append(self._build_unit(key, current))
        finally:
            saved.restore()
        check_no_meta_left(self.module)

    def _build_unit(self, key: tuple[int, int], params: list[nn.Parameter]) -> FlatUnit:
        unit = FlatUnit(index=-1, params=params, names=[self.names[id(p)] for p in params],
                        layout=layout_unit([p.numel() for p in params], self.comm.world_size),
                        rank=self.comm.rank, compute_dtype=self.compute_dtype,
                        reduce_dtype=self.reduce_dtype, group_index=key)
        staging = torch.zeros(unit.layout.padded_numel, dtype=torch.float32, device=self.device)
        for slot, p in zip(unit.layout.slots, params):
            staging[slot.offset:slot.end].copy_(p.detach().reshape(-1))
        self.comm.broadcast(staging, src=0)  # every rank starts from rank 0's values, as DDP does
        unit.shapes = [p.shape for p in params]
        unit.build_from_flat(staging, keep_full=not self.config.shard_params)
        return unit

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

    # ---- the step ---------------------------------------------------------------------
    def units_for(self, optimizer: torch.optim.Optimizer) -> list[FlatUnit]:
        return self.units_of[id(_unwrap(optimizer))]

    def grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The fp32 gradient shards of ``optimizer`` (waits for reductions still in flight)."""
        self.finish_grads()
        return [u.master.grad for u in self.units_for(optimizer) if u.master.grad is not None]

    def finish_grads(self) -> None:
        """Wait for every reduce-scatter still in flight."""
        self.reducer.wait_all()

    @torch.no_grad()
    def unscale_and_check_(self, optimizer: torch.optim.Optimizer, inv_scale: float, check: bool) -> bool:
        """Multiply the gradient shards by ``inv_scale``; True if any rank saw inf/nan (one all-reduce)."""
        grads = self.grads(optimizer)
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        if grads and (check or inv_scale != 1.0):
            inv = torch.full((1,), inv_scale, dtype=torch.float32, device=self.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        if check:
            self.comm.all_reduce(found, op="max")
        return bool(found.item() > 0)

    @torch.no_grad()
    def grad_norm(self, optimizer: torch.optim.Optimizer, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over every rank's shard (padding is zero and adds nothing)."""
        grads = self.grads(optimizer)
        if norm_type == math.inf:
            local = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros((), device=self.device)
            return self.comm.all_reduce(local.float().reshape(1), op="max")[0]
        if grads:
            local = torch.stack(torch._foreach_norm(grads, norm_type)).pow(norm_type).sum()
        else:
            local = torch.zeros((), device=self.device)
        return self.comm.all_reduce(local.float().reshape(1), op="sum")[0].pow(1.0 / norm_type)

    @torch.no_grad()
    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Like ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, across shards."""
        total = self.grad_norm(optimizer, norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = self.grads(optimizer)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return total

    @torch.no_grad()
    def clip_grad_value_(self, optimizer: torch.optim.Optimizer, clip_value: float) -> None:
        for g in self.grads(optimizer):
            g.clamp_(-clip_value, clip_value)

    @torch.no_grad()
    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Publish the stepped fp32 shards: copy into the compute-dtype shard; all-gather (stage 1/2).

        The step consumes the gradients (as in DeepSpeed): freeing the fp32 gradient shards here
        keeps them out of the next forward's peak memory, where Lightning's zero_grad comes too late.
        """
        optimizer = _unwrap(optimizer)
        units = self.units_for(optimizer)
        self.grad_bytes_at_step[id(optimizer)] = sum(
            u.master.grad.numel() * u.master.grad.element_size() for u in units if u.master.grad is not None)
        handles = []
        for unit in units:
            unit.master.grad = None
            unit.sync_shard_from_master()
            if unit.state is UnitState.UNSHARDED and unit.full is not None:
                handles.append(self.comm.all_gather(unit.full, unit.gather_source(), async_op=True))
        for handle in handles:
            handle.wait()

    def nonfinite_parameters(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """Names of parameters whose gradient shard holds inf/nan on any rank (diagnostics)."""
        bad = set()
        for unit in self.units_for(optimizer):
            grad = unit.master.grad
            if grad is None:
                continue
            for piece in unit.layout.pieces(unit.rank):
                if not torch.isfinite(grad[piece.shard_start:piece.shard_start + piece.length]).all():
                    bad.add(unit.names[piece.index])
        return sorted(set().union(*self.comm.all_gather_object(sorted(bad))))

    # ---- teardown ---------------------------------------------------------------------
    @torch.no_grad()
    def unflatten(self, device: Optional[torch.device] = None) -> None:
        """Give the module back as plain fp32 parameters holding the trained (master) values."""
        self.finish_grads()
        self.reducer.remove_hooks()
        if self.gatherer is not None:
            self.gatherer.remove_hooks()
        for unit, full in self.gather_masters():
            for param, view in zip(unit.params, unit.views(full)):
                param.data = view.clone().to(device or self.device)
                param.grad = None
            unit.full = None

    def gather_masters(self) -> Iterable[tuple[FlatUnit, torch.Tensor]]:
        """Yield each unit with its full fp32 values (one unit's full buffer alive at a time)."""
        for unit in self.units:
            if not unit.params:
                continue
            full = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=self.device)
            self.comm.all_gather(full, unit.master.detach(), async_op=False)
            yield unit, full


def _unwrap(optimizer: Union[torch.optim.Optimizer, object]) -> torch.optim.Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)
