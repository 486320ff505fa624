"""zero_auto inside a fit: the plan at setup, the measured first step, the re-plan out of GPU memory.

The strategy owns the engine; this object owns what zero_auto adds around it: the config it plans from,
the first step's measurement (replan.py) and its decision, and the host step that overlaps backward only
from the second step on (until the first step ends the masters must keep their initial values, in case
the placement moves). Every method runs on every rank; rank 0 decides and broadcasts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import Tensor

from .config import ZeroConfig
from .replan import OOM, Replanner

if TYPE_CHECKING:
    from .strategy import ZeroStrategy

__all__ = ["AutoPlacement"]

log = logging.getLogger(__name__)


class AutoPlacement:
    """The zero_auto half of a :class:`~lightning_zero.strategy.ZeroStrategy` (inactive for explicit configs)."""

    def __init__(self, strategy: ZeroStrategy) -> None:
        self.strategy = strategy
        self.base: Optional[ZeroConfig] = None  # the config it plans from (set by the first plan)
        self.replanner = Replanner()
        self.step_args: Optional[tuple] = None  # the first batch's arguments, to run it again after a move
        self.overlap_after_first: Optional[tuple] = None  # (optimizer, speculate) once re-plans are over

    @property
    def active(self) -> bool:
        return self.base is not None

    def plan(self, trainer: Any, measured: Optional[int] = None) -> None:
        """The planner picks stage and offload for these devices and this model (rank 0 decides)."""
        from .planner import plan_for_run

        s = self.strategy
        if self.base is None:
            self.base = s.config
        config, why = s.comm.broadcast_object(plan_for_run(
            s.lightning_module, s.root_device, s.num_processes, s.num_nodes, self.base,
            s.precision_plugin.compute_dtype, int(trainer.accumulate_grad_batches or 1),
            activations=self.replanner.extra, measured=measured, host_returning=s._module_bytes_on_host()), src=0)
        self._adopt(ZeroConfig.from_dict(config))
        log.info("lightning_zero zero_auto: %s", why)
        rank_zero_only(print)(f"lightning_zero zero_auto: {why}")

    def _adopt(self, config: ZeroConfig) -> None:
        self.strategy.config = config
        self.strategy.precision_plugin.configure(config, explicit=False)

    def may_probe(self) -> bool:
        """The first step, before anything changed: it may still measure and move (every rank together)."""
        s = self.strategy
        return (self.active and s.engine is not None
                and s.lightning_module.trainer.global_step == 0  # an optimizer without state stepped too
                and self.replanner.possible(list(s.optimizers)))

    def may_replan(self) -> bool:
        """Out of GPU memory in the first step: one rank only (with several, the others wait in a collective)."""
        return self.strategy.world_size == 1 and self.may_probe()

    def measured_plan(self) -> Optional[int]:
        return None if self.replanner.measured is None else self.replanner.planned_activations()

    # ---- the first step ------------------------------------------------------------------------
    def training_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Lightning's training_step through ``step``: measured (and run again after a move) in the first step."""
        if not self.may_probe():
            self.step_args = None
            if self.overlap_after_first is not None:
                self._overlap_from_now()
            return step(*args, **kwargs)
        s = self.strategy
        self.step_args = (args, kwargs)
        if self.replanner.measured is None and s.lightning_module.automatic_optimization:
            self.replanner.meter.start(s.root_device)
        try:
            return step(*args, **kwargs)
        except OOM as error:
            if not self.may_replan():
                raise
            while True:  # see replan.py
                self._replan(error)
                try:
                    return step(*args, **kwargs)
                except OOM as again:
                    if not self.may_replan():
                        raise
                    error = again

    def backward(self, backward: Callable[..., Tensor], closure_loss: Tensor, optimizer: Any, *args: Any,
                 **kwargs: Any) -> Tensor:
        """Lightning's backward through ``backward``; in the first step, the measurement and its decision."""
        if self.step_args is None or not self.may_probe():
            return backward(closure_loss, optimizer, *args, **kwargs)
        try:
            done = backward(closure_loss, optimizer, *args, **kwargs)
        except OOM as error:
            if not self.may_replan():
                raise
            del closure_loss
            self._replan(error)  # the forward's graph is gone with the old engine: run the batch again
            return self._run_batch_again(optimizer, *args, **kwargs)
        if self.strategy.lightning_module.automatic_optimization and self._probe_first_step():
            del closure_loss, done
            return self._run_batch_again(optimizer, *args, **kwargs)
        return done

    def _run_batch_again(self, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The first batch under the placement planned again (still before any optimizer step)."""
        step_args, step_kwargs = self.step_args
        out = self.strategy.training_step(*step_args, **step_kwargs)
        loss = out["loss"] if isinstance(out, Mapping) else out
        return self.strategy.backward(loss, optimizer, *args, **kwargs)

    def _rebuild(self) -> None:
        """The module back from the old engine, and the new placement's engine built (every rank)."""
        s = self.strategy
        s.model_to_device()
        s._build_engine(s.lightning_module.trainer, fitting=True)

    def _give_back(self) -> None:
        self.strategy._release_engine()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _replan(self, error: BaseException) -> None:
        """Out of GPU memory in the first step: plan again with room for what was asked, build the new
        placement's engine (see replan.py). Raises ``error`` when no other placement is left."""
        from .planner import placement_name

        s = self.strategy
        before = placement_name(s.config)
        extra = self.replanner.grow(error)
        self._give_back()
        try:
            self.plan(s.lightning_module.trainer, self.measured_plan())
        except ValueError as err:
            raise error from err
        if placement_name(s.config) == before:
            raise error
        self._rebuild()
        rank_zero_warn(f"lightning_zero zero_auto: out of GPU memory in the first step under {before}; planned again "
                       f"with {extra / 2**30:.2f} GiB more for activations: {placement_name(s.config)}, and ran "
                       f"the step again")

    def _overlap_from_now(self) -> None:
        """After the first step: the host steps during backward from now on (see ZeroStrategy._build_engine)."""
        s = self.strategy
        optimizer, speculate = self.overlap_after_first
        self.overlap_after_first = None
        blocker = s.engine.speculation_blocker(list(s.optimizers), s.num_processes) if speculate else None
        rank_zero_info(s.engine.overlap_step(None if blocker else optimizer, blocker, speculate))

    def _probe_first_step(self) -> bool:
        """After the first backward (automatic optimization): read the activation memory it used (the largest
        over the ranks); move to a placement with less traffic when the measurement leaves room for one, or to
        one that fits when the running placement does not leave room for the activations and the optimizer
        state still to come. Rank 0 decides for every rank. True when the engine was rebuilt (the batch must
        run again); see replan.py."""
        if self.replanner.measured is not None:
            return False
        s = self.strategy
        every = s.comm.all_gather_object(self.replanner.meter.read())
        if any(m is None for m in every):
            return False
        self.replanner.measured = max(every)
        config, level, message = s.comm.broadcast_object(
            self._decide_after_probe() if s.global_rank == 0 else None, src=0)
        if config is None:
            (rank_zero_warn if level == "warn" else rank_zero_info)(message)
            return False
        self._give_back()
        self._adopt(ZeroConfig.from_dict(config))
        self._rebuild()
        rank_zero_warn(message)
        return True

    def _decide_after_probe(self) -> tuple[Optional[dict], str, str]:
        """(the placement to move to as a dict, or None to stay; "info" / "warn"; the line to say) for the
        measured first step, on this rank's view of the machine."""
        from .host_memory import read_host_budget
        from .planner import fits_measured, lighter, placement_name, plan_for_run

        s = self.strategy
        measured = self.replanner.measured
        trainer = s.lightning_module.trainer
        before, measured_gib = placement_name(s.config), f"{measured / 2**30:.2f} GiB"
        accumulate = int(trainer.accumulate_grad_batches or 1)
        place = (s.lightning_module, s.root_device, s.num_processes, s.num_nodes)
        dtype = s.precision_plugin.compute_dtype
        held = s.engine.held_host_bytes() if s.engine is not None else 0  # given back before a move
        fits_now = fits_measured(*place, s.config, dtype, accumulate, self.measured_plan(), host_returning=held)
        try:
            config, why = plan_for_run(*place, self.base, dtype, accumulate, measured=self.measured_plan(),
                                       host_returning=held)
            found: Optional[ZeroConfig] = ZeroConfig.from_dict(config)
        except ValueError:  # nothing fits the estimate (the running placement did run its forward and backward)
            found = None
        if found is None or (fits_now and not lighter(found, s.config)):
            if fits_now:
                return None, "info", (f"lightning_zero zero_auto: the first step used {measured_gib} for "
                                      f"activations; {before} stays")
            return None, "warn", (f"lightning_zero zero_auto: the first step used {measured_gib} for activations, "
                                  f"more than {before} leaves room for beside the optimizer state its first step "
                                  f"creates, and no placement leaves enough: {before} stays and may run out of GPU "
                                  f"memory (a smaller micro-batch, activation checkpointing or more GPUs make room)")
        module_bytes = 4 * sum(p.numel() for p in s.lightning_module.parameters())
        budget = read_host_budget(s.num_processes)
        if module_bytes + budget.headroom_per_rank > budget.per_rank:  # the switch hands the module back in host memory
            return None, "info" if fits_now else "warn", (
                f"lightning_zero zero_auto: the first step used {measured_gib} for activations, so "
                f"{placement_name(found)} {'would fit' if fits_now else 'is needed'}, but moving there needs the "
                f"fp32 module ({module_bytes / 2**30:.1f} GiB) in host memory and the host can give "
                f"{budget.describe()}: {before} stays (name the placement to start with it)")
        how = ("less than kept free" if fits_now else
               f"more than {before} leaves room for beside the optimizer state its first step creates")
        return found.to_dict(), "warn", (f"lightning_zero zero_auto: the first step used {measured_gib} for "
                                         f"activations, {how}: moved from {before} to {placement_name(found)} and "
                                         f"ran the step again ({why})")
