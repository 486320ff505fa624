"""What the Lightning loop will do, read off the Trainer and the module (public API only).

The strategy turns these facts into engine policies: whether gradients may be freed at the
step, whether the host may step during backward, and whether evaluation batches are even.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional

import torch

__all__ = ["zero_grad_before_next_backward", "overlap_blocker", "gradient_readers", "gradient_changers", "uneven_batches", "uneven_batches_error", "RepeatLastBatch", "replay_finetuning_restore",
           "hold_schedulers_on_skip", "checkpoint_readers"]

_GRAD_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def _overridden(name: str, obj: Any, base: type) -> bool:
    return getattr(type(obj), name, None) is not getattr(base, name, None)


def zero_grad_before_next_backward(module: Any) -> bool:
    """Automatic optimization with the stock ``optimizer_zero_grad`` clears the gradients before any next
    backward: the engine may free them at the step (see [Note: when gradients are freed] in the engine)."""
    import lightning.pytorch as pl

    return bool(module.automatic_optimization) and not _overridden("optimizer_zero_grad", module, pl.LightningModule)


def overlap_blocker(trainer: Any, module: Any, optimizers: list[Any]) -> Optional[str]:
    """Why the host step may not start during backward (None: it may): a user hook between backward and the
    step could change the gradients, or the step happens elsewhere."""
    import lightning.pytorch as pl

    if len(optimizers) != 1:
        return "several optimizers"
    if not module.automatic_optimization:
        return "manual optimization"
    for name in (*_GRAD_HOOKS, "configure_gradient_clipping", "optimizer_step"):
        if _overridden(name, module, pl.LightningModule):
            return f"the module overrides {name}"
    for callback in trainer.callbacks:
        for name in _GRAD_HOOKS:
            if _overridden(name, callback, pl.Callback):
                return f"{type(callback).__name__}.{name}"
    return None


def gradient_readers(trainer: Any, module: Any) -> list[str]:
    """The user hooks that might read ``p.grad`` after backward (None here: the gradients are in the engine)."""
    import lightning.pytorch as pl

    found = [f"{type(module).__name__}.{name}" for name in _GRAD_HOOKS if _overridden(name, module, pl.LightningModule)]
    found += [f"{type(c).__name__}.{name}" for c in trainer.callbacks for name in _GRAD_HOOKS
              if _overridden(name, c, pl.Callback)]
    return found


def gradient_changers(trainer: Any, loss_scaling: bool) -> Optional[str]:
    """What of the engine's own may still change gradients between backward and the step (global clipping,
    the fp16 overflow vote), making a host step during backward speculative; None: nothing."""
    found = [what for what, present in (("gradient clipping", bool(trainer.gradient_clip_val)),
                                         ("fp16 loss scaling", loss_scaling)) if present]
    return " and ".join(found) or None


def uneven_batches(loop: Any, comm: Any, device: torch.device) -> Optional[tuple[list[int], list[int], list[int]]]:
    """(this rank's, the fewest, the most) batches per dataloader of an evaluation loop when the ranks' counts
    differ; None when they agree or a loader has no length (then the collective timeout names a mismatch).
    One all-reduce per bound."""
    counts = [float(n) for n in getattr(loop, "max_batches", [])]
    if comm.world_size == 1 or not counts or float("inf") in counts:
        return None
    mine = torch.tensor(counts, dtype=torch.float64, device=device)
    high, low = comm.all_reduce(mine.clone(), op="max"), -comm.all_reduce(-mine, op="max")
    if torch.equal(high, low):
        return None
    return [int(c) for c in counts], [int(x) for x in low.tolist()], [int(x) for x in high.tolist()]


class RepeatLastBatch:
    """Stage-3 predict over ranks with unequal batch counts: after a rank's last batch of a dataloader it runs
    that batch again (outputs dropped) as many times as the busiest rank has batches more, so that every rank
    issues the same gathers. Lightning's predict sampler hands the extra samples to the first ranks, at the end."""

    def __init__(self, mine: list[int], high: list[int]) -> None:
        self.mine, self.high, self.seen = mine, high, [0] * len(mine)

    def after_step(self, step: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        index = args[2] if len(args) > 2 else kwargs.get("dataloader_idx", 0)
        self.seen[index] += 1
        if self.seen[index] == self.mine[index]:
            for _ in range(self.high[index] - self.mine[index]):
                step(*args, **kwargs)


def uneven_batches_error(stage: str, mine: list[int], low: list[int], high: list[int]) -> RuntimeError:
    fix = ("Use Lightning's DistributedSampler (use_distributed_sampler=True, the default), make your sampler give "
           "every rank the same number of batches, or evaluate with stage 1/2.")
    if stage == "predict":  # a rank with fewer predict batches repeats its last one (RepeatLastBatch)
        fix = "A rank with no predict batch has none to repeat: give every rank a batch, or predict with stage 1/2."
    return RuntimeError(
        f"ZeroStrategy(stage=3): ranks have different numbers of {stage} batches (this rank: {mine}, between {low} "
        f"and {high} across ranks). Every stage-3 forward gathers parameters on all ranks, so uneven batches would "
        f"hang. {fix}")


def replay_finetuning_restore(trainer: Any, module: Any) -> None:
    """Fine-tuning callbacks re-create the param groups they added in ``on_fit_start``. With a checkpoint
    restored after setup their state loads after that hook, so the groups must be re-created now, before
    the optimizer state that refers to them loads."""
    from lightning.pytorch.callbacks import BaseFinetuning

    from .lightning_compat import is_restarting

    for callback in trainer.callbacks:
        if isinstance(callback, BaseFinetuning) and is_restarting(callback):
            callback.on_fit_start(trainer, module)


def hold_schedulers_on_skip(trainer: Any, module: Any, step_applied: Callable[[Any], Optional[bool]]
                            ) -> Callable[[], None]:
    """Lightning steps ``interval="step"`` schedulers after every optimizer step, a step skipped for fp16
    overflow too; DeepSpeed does not (Lightning issues 5558, 18828). Wrap this module's ``lr_scheduler_step``
    so that such a scheduler is not stepped when its optimizer's last step was skipped (``step_applied``
    returns False). Epoch schedulers are untouched. Returns the undo (the strategy's teardown calls it)."""
    original = module.lr_scheduler_step

    @functools.wraps(original)  # Lightning's is_overridden looks through __wrapped__: the user's override stays seen
    def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
        config = next((c for c in trainer.lr_scheduler_configs if c.scheduler is scheduler), None)
        optimizer = getattr(scheduler, "optimizer", None)
        if config is not None and config.interval == "step" and optimizer is not None \
                and step_applied(optimizer) is False:
            return None
        return original(scheduler, metric)

    module.lr_scheduler_step = lr_scheduler_step

    def undo() -> None:
        if module.__dict__.get("lr_scheduler_step") is lr_scheduler_step:
            del module.lr_scheduler_step

    return undo


def checkpoint_readers(trainer: Any, module: Any, users_only: bool = False) -> list[str]:
    """The hooks that see the checkpoint dict ``trainer.save_checkpoint`` builds: the module's and the
    callbacks' own ``on_save_checkpoint`` (Lightning's callbacks that have one, weight averaging and
    pruning, read the state dict too; ``users_only`` leaves those out)."""
    import lightning.pytorch as pl

    readers = [f"{type(module).__name__}.on_save_checkpoint"] if _overridden("on_save_checkpoint", module,
                                                                              pl.LightningModule) else []
    return readers + [f"{type(c).__name__}.on_save_checkpoint" for c in trainer.callbacks
                      if _overridden("on_save_checkpoint", c, pl.Callback)
                      and not (users_only and type(c).__module__.startswith(("lightning.", "pytorch_lightning.")))]
