"""Model summary with real parameter counts while stage 3 holds only shards.

Lightning's ModelSummary counts ``p.numel()``, which is 0 for a sharded (empty) parameter.
These subclasses count the shapes the engine recorded instead.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary.model_summary import LayerSummary, ModelSummary

from .lightning_compat import model_summary_settings

__all__ = ["ZeroModelSummary", "install_summary"]


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


class ZeroModelSummary(ModelSummaryCallback):
    """Lightning's ModelSummary callback, counting stage-3 parameters at their full size."""

    def _summary(self, trainer: Any, pl_module: Any) -> ModelSummary:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None or not engine.config.shard_params:
            return super()._summary(trainer, pl_module)
        numels = {id(p): shape.numel() for u in engine.units for p, shape in zip(u.params, u.shapes)}
        return _ZeroSummary(pl_module, numels, max_depth=self._max_depth)


def install_summary(trainer: Any) -> None:
    """Swap Lightning's ModelSummary callbacks for ours (same settings)."""
    callbacks = trainer.callbacks
    for i, cb in enumerate(callbacks):
        if type(cb) is ModelSummaryCallback:
            max_depth, kwargs = model_summary_settings(cb)
            replacement = ZeroModelSummary(max_depth=max_depth, **kwargs)
            callbacks[i] = replacement
