"""lightning_zero: DeepSpeed-style ZeRO for PyTorch Lightning, in pure PyTorch.

``import lightning_zero`` registers the strategy names ``zero1``, ``zero2``, ``zero3``,
``zero2_offload``, ``zero3_offload``, ``zero3_offload_nvme`` and ``zero_auto`` with Lightning,
so ``Trainer(strategy="zero3")`` works after it.
"""

from lightning.pytorch.strategies import StrategyRegistry

from . import accelerator, checkpointing, comm, ops, utils, zero
from .api import ZeroModelEngine, add_config_arguments, init_distributed, initialize
from .config import ZeroConfig, ZeroConfigError
from .engine import UnsupportedOptimizerError, ZeroEngine
from .precision import DynamicLossScaler, LossScaleAtMinimumError
from .precision.plugin import ZeroPrecision
from .strategy import ZeroStrategy

DeepSpeedEngine = ZeroModelEngine  # scripts that check isinstance(engine, deepspeed.DeepSpeedEngine)

__all__ = ["initialize", "init_distributed", "add_config_arguments", "zero", "utils", "ops", "DeepSpeedEngine", "comm", "accelerator", "checkpointing", "ZeroModelEngine", "ZeroConfig", "ZeroConfigError", "ZeroEngine", "ZeroPrecision", "ZeroStrategy", "DynamicLossScaler",
           "LossScaleAtMinimumError", "UnsupportedOptimizerError"]
__version__ = "0.1.0"


def _register() -> None:
    # Lightning only discovers register_strategies in its own package; a re-import must not fail.
    from .presets import PRESETS

    for name, _, _ in PRESETS:
        StrategyRegistry.pop(name, None)
    ZeroStrategy.register_strategies(StrategyRegistry)


def _load_directories() -> None:
    # LightningModule.load_from_checkpoint(DIR) on a sharded (or DeepSpeed) checkpoint directory just works
    from .checkpoint.export import read_directory
    from .lightning_compat import load_directories_in_load_from_checkpoint

    load_directories_in_load_from_checkpoint(read_directory)


_register()
_load_directories()
