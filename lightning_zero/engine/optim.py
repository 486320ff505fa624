"""Adopting the user's optimizer: keep the object, point its param groups at fp32 shards.

[Note: why keep the user's optimizer]
LR schedulers, Lightning's LightningOptimizer and user code hold references to the
optimizer object. Replacing ``param_groups[i]["params"]`` with the flat fp32 master shards
of that group keeps every such reference valid, and every hyper-parameter (lr, betas,
weight decay per group) applies unchanged. This is exact only for optimizers whose update
is elementwise: each element's new value depends on that element's own history alone.
"""

from __future__ import annotations

import inspect
from collections import defaultdict

import torch
from torch import nn

__all__ = ["ELEMENTWISE_OPTIMIZERS", "UnsupportedOptimizerError", "check_optimizer", "point_at_masters"]

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in
    ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
    if hasattr(torch.optim, name)
)


class UnsupportedOptimizerError(TypeError):
    """The optimizer's math is not known to be exact on flat shards."""


def check_optimizer(optimizer: torch.optim.Optimizer, allow_untested: bool) -> None:
    """Refuse optimizers whose update is not known to be elementwise.

    A subclass of a known optimizer passes only if it does not override ``step``.
    """
    # torch wraps ``step`` of each optimizer class for profiling: compare the unwrapped functions.
    step = inspect.unwrap(type(optimizer).step)
    if any(isinstance(optimizer, cls) and step is inspect.unwrap(cls.step) for cls in ELEMENTWISE_OPTIMIZERS):
        return
    if allow_untested:
        return
    names = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
    raise UnsupportedOptimizerError(
        f"lightning_zero steps the optimizer on flat parameter shards, which is exact only for "
        f"elementwise optimizers ({names}). {type(optimizer).__name__} is not one of them, so its "
        f"result could differ from unsharded training. Use one of those, or set "
        f"ZeroConfig(allow_untested_optimizer=True) if you know its update is elementwise."
    )


def point_at_masters(optimizer: torch.optim.Optimizer, masters_per_group: list[list[nn.Parameter]]) -> None:
    """Replace each param group's parameters by its master shards; start with empty state."""
    if any(len(s) for s in optimizer.state.values()):
        raise RuntimeError(
            "The optimizer already holds state before lightning_zero sharded it. Create it in "
            "configure_optimizers without stepping it, or restore its state from a checkpoint after setup."
        )
    for group, masters in zip(optimizer.param_groups, masters_per_group):
        group["params"] = list(masters)
    optimizer.state = defaultdict(dict)
