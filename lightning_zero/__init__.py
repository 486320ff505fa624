"""lightning_zero: DeepSpeed-style ZeRO for PyTorch Lightning, in pure PyTorch."""

from .config import ZeroConfig, ZeroConfigError

__all__ = ["ZeroConfig", "ZeroConfigError"]
