"""Mixed precision: the pure loss scaler and the Lightning precision plugin."""

from .loss_scaler import DynamicLossScaler, LossScaleAtMinimumError

__all__ = ["DynamicLossScaler", "LossScaleAtMinimumError"]
