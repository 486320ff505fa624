"""What a DeepSpeed JSON asks of a run, for both front ends.

:mod:`lightning_zero.ds_config` reads the file into a :class:`DeepSpeedImport`; this module
applies it: the optimizer and scheduler it describes, the Trainer settings it carries
(clipping, accumulation, precision), and DeepSpeed's batch arithmetic. The Lightning strategy
and ``lightning_zero.initialize`` both call these, so both honour a file the same way.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

from .config import ZeroConfig
from .ds_config import (
    DeepSpeedConfigError,
    DeepSpeedImport,
    build_optimizer,
    check_batch,
    import_deepspeed_config,
    resolve_batch,
)

__all__ = ["resolve", "optimizer_and_scheduler", "configure_optimizers_from", "install_optimizers", "apply_to_trainer",
           "precision_for", "check_loader_batch"]


def resolve(config: Optional[ZeroConfig], deepspeed_config: Any, options: dict[str, Any],
            warn: Callable[[str], None]) -> tuple[ZeroConfig, Optional[DeepSpeedImport]]:
    """The run's config: ``config``, filled by the DeepSpeed JSON where it says something, then ``options``
    (explicit keyword arguments win over both)."""
    from .presets import as_config

    ds = None
    config = as_config(config)
    base = config or ZeroConfig()
    if deepspeed_config is not None:
        ds = import_deepspeed_config(deepspeed_config, base=config)
        base = ds.zero
        if ds.warnings:
            warn("lightning_zero read the DeepSpeed config: " + "; ".join(ds.warnings) + ".")
    return (base.replace(**options) if options else base), ds


def _made(given: Any, argument: Any, name: str, what: str, kind: str) -> Any:
    """DeepSpeed's rule for ``optimizer=`` / ``lr_scheduler=``: an object is used as it is, a callable (a class
    included) is called with ``what``. An object that only looks like one (it has a ``step``) stays as given."""
    if not callable(given) or (hasattr(given, "step") and not isinstance(given, type)):
        return given
    try:
        made = given(argument)
    except TypeError as err:
        raise ValueError(f"lightning_zero.initialize: {name}={getattr(given, '__name__', given)!r} is called with "
                         f"{what} (DeepSpeed's rule for a callable) and failed: {err}. Pass a built {kind}, or a "
                         f"callable of {what} alone (functools.partial / a lambda fixing the other arguments).") from err
    return made


def optimizer_and_scheduler(ds: DeepSpeedImport, params: Any, optimizer: Any = None,
                            lr_scheduler: Any = None) -> tuple[Any, Any]:
    """The optimizer and scheduler of a run: the caller's (objects, or callables taking the parameters /
    the optimizer) over the file's."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = _made(optimizer, params, "optimizer", "the model's parameters", "torch.optim.Optimizer")
    if optimizer is None:
        if ds.optimizer is None:
            raise ValueError("lightning_zero.initialize needs an optimizer: pass optimizer=... or put an \"optimizer\" "
                             "section in the config.")
        optimizer = build_optimizer(ds.optimizer, params)
    if lr_scheduler is not None and not isinstance(lr_scheduler, LRScheduler):
        lr_scheduler = _made(lr_scheduler, optimizer, "lr_scheduler", "the optimizer", "LRScheduler")
    if lr_scheduler is None and ds.scheduler is not None:
        from .ds_schedules import build_scheduler

        lr_scheduler = build_scheduler(optimizer, ds.scheduler)
    return optimizer, lr_scheduler


def configure_optimizers_from(ds: DeepSpeedImport) -> Callable:
    """``configure_optimizers`` for a module that has none: the file's optimizer and (per-step) scheduler."""

    def configure_optimizers(module: Any) -> Any:
        optimizer, scheduler = optimizer_and_scheduler(ds, [p for p in module.parameters() if p.requires_grad])
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return configure_optimizers


def install_optimizers(ds: DeepSpeedImport, model: Any, warn: Callable[[str], None]) -> None:
    """Give ``model`` the file's optimizer unless it configures its own (then say the file's is ignored)."""
    if ds.optimizer is None:
        return
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if is_overridden("configure_optimizers", model):
        warn("The DeepSpeed config's optimizer/scheduler are ignored: the LightningModule configures its own in "
             "configure_optimizers.")
    else:
        model.configure_optimizers = types.MethodType(configure_optimizers_from(ds), model)


def apply_to_trainer(ds: DeepSpeedImport, trainer: Any, world_size: int = 1) -> None:
    """``gradient_clipping`` and ``gradient_accumulation_steps`` of the file (stated, or derived from the batch
    sizes as DeepSpeed derives it), unless the Trainer says otherwise."""
    if ds.gradient_clip_val is not None:
        if trainer.gradient_clip_val not in (None, 0, ds.gradient_clip_val):
            raise DeepSpeedConfigError(f"gradient_clipping={ds.gradient_clip_val} in the DeepSpeed config but "
                                       f"Trainer(gradient_clip_val={trainer.gradient_clip_val}): keep one of them.")
        algorithm = str(getattr(trainer, "gradient_clip_algorithm", None) or "norm")
        if algorithm.lower().endswith("value"):
            raise DeepSpeedConfigError(f"gradient_clipping={ds.gradient_clip_val} in the DeepSpeed config is a norm "
                                       f"clip, but Trainer(gradient_clip_algorithm='value') would apply it to each "
                                       f"value: drop gradient_clip_algorithm, or the JSON's gradient_clipping and set "
                                       f"Trainer(gradient_clip_val=...) instead.")
        trainer.gradient_clip_val = ds.gradient_clip_val
    accumulate = ds.accumulate
    if accumulate is None and ds.train_batch_size is not None and ds.micro_batch_per_gpu is not None:
        accumulate = resolve_batch(ds.train_batch_size, ds.micro_batch_per_gpu, None, world_size)[2]
    if accumulate is not None and trainer.accumulate_grad_batches == 1:
        trainer.accumulate_grad_batches = accumulate


def precision_for(ds: Optional[DeepSpeedImport], given: Optional[str], ours: bool) -> Optional[str]:
    """The precision a run takes when the file names one: the file's when the Trainer kept its default
    ("32-true"), an error when they differ. None: keep the plugin as given."""
    wanted = ds.precision if ds is not None else None
    if wanted is None or given is None:
        return None
    if given not in ("32-true", "32", wanted) and not ours:
        raise DeepSpeedConfigError(f"The DeepSpeed config asks for {wanted} but the Trainer has precision="
                                   f"{given!r}: drop precision= from the Trainer or change fp16/bf16 in the JSON.")
    return wanted if given in ("32-true", "32") else None


def check_loader_batch(ds: DeepSpeedImport, trainer: Any, world_size: int) -> None:
    """DeepSpeed's ``train_batch_size = micro-batch x accumulation x world size`` against the real loader."""
    loader = trainer.train_dataloader
    batch = getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    check_batch(ds, batch, world_size, trainer.accumulate_grad_batches)
