"""Everything the strategy needs from Lightning that Lightning offers no public way to reach.

Each name here wraps one private attribute or function, so that a Lightning release that moves
it breaks here, in one place, with a test saying which (tests/test_lightning_compat.py, run
against every Lightning minor version we support). Nothing else in lightning_zero reads a
Lightning private.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities import distributed as _fabric_distributed

__all__ = ["lightning_optimizers", "is_restarting", "init_process_group", "destroy_process_group",
           "default_backend_for", "set_launcher", "summary_depth", "load_directories_in_load_from_checkpoint",
           "mark_checkpoint_dumps", "record_module_device"]


def lightning_optimizers(strategy: Any) -> list[Any]:
    """The ``LightningOptimizer`` wrappers ``self.optimizers()`` hands to a module (manual optimization).

    Lightning rebuilds them whenever ``strategy.optimizers`` is set (``Strategy._lightning_optimizers``).
    """
    return list(getattr(strategy, "_lightning_optimizers", []))


def record_module_device(module: Any, device: torch.device) -> None:
    """What ``LightningModule.device`` answers (``_DeviceDtypeModuleMixin._device``, set by ``.to()``): the
    strategy places the module without ``.to()`` (the engine moves its parameters unit by unit), so it tells
    Lightning here; ``torch.zeros(..., device=self.device)`` in a user's step then lands on the GPU."""
    from lightning.fabric.utilities.device_dtype_mixin import _update_properties

    _update_properties(module, device=device)


def is_restarting(callback: Any) -> bool:
    """A fine-tuning callback restored from a checkpoint re-creates its param groups (``BaseFinetuning._restarting``)."""
    return bool(getattr(callback, "_restarting", False))


def init_process_group(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """Lightning's own process-group start (``_init_dist_connection``): reads the cluster environment's
    rank, world size and address, as every Lightning strategy does."""
    _fabric_distributed._init_dist_connection(cluster_environment, backend, **kwargs)


def destroy_process_group() -> None:
    """Lightning's ``_destroy_dist_connection`` (a no-op when no group is up)."""
    _fabric_distributed._destroy_dist_connection()


def default_backend_for(device: torch.device) -> str:
    """``nccl`` on CUDA devices, ``gloo`` elsewhere (``_get_default_process_group_backend_for_device``)."""
    return _fabric_distributed._get_default_process_group_backend_for_device(device)


def set_launcher(strategy: Any, launcher: Any) -> None:
    """A strategy's ``_configure_launcher`` sets ``_launcher`` (Lightning's own strategies do the same)."""
    strategy._launcher = launcher


def summary_depth(callback: Any) -> int:
    """A ``ModelSummary`` callback's ``max_depth`` (its ``_summary(trainer, module)`` builds the table it prints)."""
    return callback._max_depth


def load_directories_in_load_from_checkpoint(read_directory: Any) -> None:
    """``LightningModule.load_from_checkpoint(path)`` reads ``path`` with ``lightning.pytorch.core.saving.pl_load``,
    which fails on a directory (``IsADirectoryError``). Route directories (our sharded checkpoints,
    DeepSpeed's) through ``read_directory(path, map_location)``; files go to Lightning's own loader as before.
    Idempotent."""
    from lightning.pytorch.core import saving

    original = getattr(saving.pl_load, "__wrapped__", saving.pl_load)

    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        import os

        if isinstance(path_or_url, (str, os.PathLike)) and os.path.isdir(path_or_url):
            return read_directory(path_or_url, map_location)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load.__wrapped__ = original  # type: ignore[attr-defined]
    saving.pl_load = pl_load


def mark_checkpoint_dumps(trainer: Any, dumping: Any) -> None:
    """Call ``dumping(True)`` / ``dumping(False)`` around the trainer's building of a checkpoint dict
    (``trainer._checkpoint_connector.dump_checkpoint``, which ``trainer.save_checkpoint`` and
    ModelCheckpoint use). Idempotent per trainer."""
    connector = trainer._checkpoint_connector
    current = connector.dump_checkpoint
    if getattr(current, "_marks", None) is dumping:
        return
    original = getattr(current, "__wrapped__", current)

    def dump_checkpoint(weights_only: Any = None) -> Any:
        dumping(True)
        try:
            return original(weights_only)
        finally:
            dumping(False)

    dump_checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
    dump_checkpoint._marks = dumping  # type: ignore[attr-defined]
    connector.dump_checkpoint = dump_checkpoint


def tell_throughput_monitors(trainer: Any, device: torch.device, compute_dtype: torch.dtype) -> None:
    """Lightning's ThroughputMonitor takes the peak FLOPs for its MFU from the precision plugins it knows; ours it
    counts as fp32 (an MFU 15x too high in bf16 on an H100). Give it the peak of the dtype the GPU computes in."""
    from lightning.fabric.utilities.throughput import get_available_flops
    from lightning.pytorch.callbacks import ThroughputMonitor

    for callback in trainer.callbacks:
        if isinstance(callback, ThroughputMonitor):
            flops = get_available_flops(device, compute_dtype)
            callback.available_flops = flops
            for throughput in callback._throughputs.values():
                throughput.available_flops = flops
