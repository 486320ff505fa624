"""The ZeRO core, independent of Lightning."""

from .engine import ZeroEngine, dtype_of
from .flat_unit import FlatUnit, UnitState
from .optim import ELEMENTWISE_OPTIMIZERS, UnsupportedOptimizerError

__all__ = ["ZeroEngine", "dtype_of", "FlatUnit", "UnitState", "ELEMENTWISE_OPTIMIZERS", "UnsupportedOptimizerError"]
