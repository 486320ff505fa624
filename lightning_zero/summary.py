"""Model summary with real parameter counts while stage 3 holds only shards.

Lightning's ModelSummary counts ``p.numel()``, which is 0 for a sharded (empty) parameter.
These subclasses count the shapes the engine recorded instead.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary.model_summary import LayerSummary, ModelSummary

from .lightning_compat import summary_depth

__all__ = ["full_numels", "install_summary"]


def _numel(numels: dict[int, int], p: Any) -> int:
    return numels.get(id(p), p.numel())


class _ZeroLayerSummary(LayerSummary):
    def __init__(self, module: Any, numels: dict[int, int]) -> None:
        super().__init__(module)
        self._numels = numels

    @property
    def num_parameters(self) -> int:
        return sum(_numel(self._numels, p) for p in self._module.parameters())


class _ZeroSummary(ModelSummary):
    def __init__(self, model: Any, numels: dict[int, int], max_depth: int = 1) -> None:
        self._numels = numels
        super().__init__(model, max_depth=max_depth)

    def summarize(self) -> dict[str, LayerSummary]:
        summary = OrderedDict((name, _ZeroLayerSummary(m, self._numels)) for name, m in self.named_modules)
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for key in [k for k in summary if k.count(".") >= self._max_depth]:
                del summary[key]
        return summary

    @property
    def total_parameters(self) -> int:
        return sum(_numel(self._numels, p) for p in self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        return sum(_numel(self._numels, p) for p in self._model.parameters() if p.requires_grad)


def full_numels(trainer: Any) -> Optional[dict[int, int]]:
    """id(parameter) -> its full size, while a stage-3 engine holds the parameters as shards (else None)."""
    engine = getattr(trainer.strategy, "engine", None)
    if engine is None or not engine.config.shard_params:
        return None
    return {id(p): shape.numel() for u in engine.units for p, shape in zip(u.params, u.shapes)}


def install_summary(trainer: Any) -> None:
    """Make each ModelSummary callback (Lightning's, RichModelSummary, a user's subclass) count full sizes: its
    ``_summary`` builds the table, which the callback then prints its own way. Idempotent."""
    for callback in trainer.callbacks:
        if not isinstance(callback, ModelSummaryCallback) or getattr(callback, "_zero_counts", False):
            continue
        original = callback._summary

        def _summary(trainer: Any, pl_module: Any, original: Any = original, callback: Any = callback) -> Any:
            numels = full_numels(trainer)
            if numels is None:
                return original(trainer, pl_module)
            return _ZeroSummary(pl_module, numels, max_depth=summary_depth(callback))

        callback._summary = _summary
        callback._zero_counts = True
