"""When the host steps the offloaded units: after backward, during it, speculatively, or one step late.

:meth:`HostSchedule.set` is asked by the caller (the Lightning strategy, the DeepSpeed-style engine), which
knows what may change gradients between backward and the step; it returns the line that tells the user.
Under ``speculative_step="auto"`` the first steps run after backward while a :class:`SpeculationTrial`
times them, and at its end the ranks decide together whether a speculative step pays here.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional

import torch

from .optim import unwrap
from .speculation_trial import WINDOWS, SpeculationTrial, host_copy_seconds_per_byte, pays

if TYPE_CHECKING:
    from .engine import ZeroEngine
    from .flat_unit import FlatUnit

__all__ = ["HostSchedule"]


class HostSchedule:
    def __init__(self, engine: ZeroEngine) -> None:
        self._engine = weakref.ref(engine)  # no cycle: an engine given back is freed by its last reference
        self.trial: Optional[SpeculationTrial] = None  # speculative_step='auto': the trial while it runs
        self.verdict: Any = None  # then its verdict (True, or "no:<why>")
        self.decision = ""  # and the line that says why

    @property
    def engine(self) -> ZeroEngine:
        return self._engine()

    @property
    def speculating(self) -> bool:
        return self.engine.offloader is not None and self.engine.offloader.speculating

    def set(self, optimizer: Optional[torch.optim.Optimizer], blocker: Optional[str] = None,
            speculate: Optional[str] = None) -> str:
        """Let the host step ``optimizer``'s offloaded units during backward (None: not anymore, because of
        ``blocker``); returns a line saying what is offloaded and when the host steps.

        The caller checks that only the engine's own clipping and overflow vote can change gradients between
        backward and the step (one optimizer, no user hook before the step). ``speculate`` names those when
        present: then the early steps are speculative (see engine.speculation), unless
        ``speculative_step=False``.
        """
        engine = self.engine
        offloader, config = engine.offloader, engine.config
        if offloader is None:
            return "lightning_zero: nothing offloaded"
        described = f"lightning_zero {engine.describe_offload()}; host step "
        if config.delayed_step:
            offloader.disable_overlap()
            engine.reducer.tell_late(offloader.late_gradient)  # a unit published early must not get one
            return described + ("one step late (delayed_step): step t's host update runs during window t+1, "
                                "from gradients one step stale; each unit's new values go up once its "
                                "backward in t+1 is done")
        mode = config.speculative_step if self.verdict is None else self.verdict
        if speculate and mode is False:
            blocker = f"{speculate}, speculative_step=False"
        if speculate and mode == "auto" and optimizer is not None and not blocker and config.overlap_step:
            self.trial = SpeculationTrial(optimizer, speculate, engine.device)
            offloader.disable_overlap()
            return described + (f"after backward for the first {WINDOWS} steps ({speculate}; speculative_step='auto' "
                                f"times them to see whether a speculative step pays here)")
        if speculate and isinstance(mode, str) and mode.startswith("no:"):
            blocker = mode[3:]
        if optimizer is None or blocker or not config.overlap_step:
            offloader.disable_overlap()
            return described + f"after backward ({blocker or 'overlap_step=False'})"
        optimizer = unwrap(optimizer)

        def fully_used(unit: FlatUnit) -> bool:
            used = engine.reducer.used_slots(unit)
            return all(i in used for i, p in enumerate(unit.params) if p.requires_grad)

        def publish_own(units: list[FlatUnit]) -> None:
            for unit in units:
                unit.publish_own()  # the others' chunks come at the step

        offloader.enable_overlap(optimizer, engine.routes.inner_step(optimizer), fully_used, publish_own,
                                 speculative=bool(speculate))
        engine.reducer.tell_late(offloader.overlap.late_gradient if offloader.overlap is not None else None)
        if speculate and offloader.overlap is not None:
            return described + f"overlaps backward, speculatively ({speculate}: redone when they change gradients)"
        return described + "overlaps backward"

    def blocker(self, optimizers: list[Any], ranks_on_node: int) -> Optional[str]:
        """Why the host step may not speculate here (no host memory for its copy, on some rank), or None.
        A collective: every rank decides alike."""
        from ..host_memory import read_host_budget, speculation_room

        offloader = self.engine.offloader
        if offloader is None:
            return None
        problem = speculation_room(offloader.speculation_bytes(optimizers), offloader.pending_host_bytes(optimizers),
                                   read_host_budget(ranks_on_node))
        return next((p for p in self.engine.comm.all_gather_object(problem) if p), None)

    def backward_started(self) -> None:
        if self.trial is not None:
            self.trial.backward_started()

    def backward_ended(self) -> None:
        if self.trial is not None:
            self.trial.backward_ended()

    def step_ended(self) -> None:
        """speculative_step='auto': a step ended; with enough timings, the ranks decide together (a collective
        at the same step on every rank) and the host step is set up accordingly."""
        trial, engine = self.trial, self.engine
        if trial is None or not trial.stepped():
            return
        self.trial = None
        backward = trial.backward_seconds()
        copy = engine.offloader.speculation_bytes([trial.optimizer]) * host_copy_seconds_per_byte()
        worst = torch.tensor([copy / max(backward, 1e-9)], device=engine.device)
        if engine.comm.world_size > 1:
            engine.comm.all_reduce(worst, op="max")
        figures = f"the safety copy ~{copy:.3f} s against a backward of {backward:.3f} s"
        room = self.blocker([trial.optimizer], engine.ranks_on_node)  # a collective, on every rank
        if room:
            self.verdict = f"no:{room}"
            self.decision = f"after backward: {room}"
        elif pays(float(worst) * backward, backward):
            self.verdict = True
            self.decision = f"speculative: {figures}"
        else:
            self.verdict = f"no:speculative_step='auto' measured {figures}, too dear to hide it"
            self.decision = f"after backward: {figures}"
        engine.say(self.set(trial.optimizer, None, trial.speculate))
