"""The few things the strategy needs from Lightning that Lightning offers no public way to read.

Each function names the private attribute it reads, so that a Lightning release that moves it
breaks here, in one place, with a test (tests/test_lightning_compat.py) saying which.
"""

from __future__ import annotations

from typing import Any

__all__ = ["lightning_optimizers"]


def lightning_optimizers(strategy: Any) -> list[Any]:
    """The ``LightningOptimizer`` wrappers ``self.optimizers()`` hands to a module (manual optimization).

    Lightning rebuilds them whenever ``strategy.optimizers`` is set (``Strategy._lightning_optimizers``).
    """
    return list(getattr(strategy, "_lightning_optimizers", []))
