"""The strategy names ``import lightning_zero`` registers with Lightning, and the config each one stands for."""

from __future__ import annotations

from .config import ZeroConfig

__all__ = ["PRESETS"]

PRESETS = (
    ("zero1", "ZeRO stage 1: shards optimizer state", ZeroConfig(stage=1)),
    ("zero2", "ZeRO stage 2: shards optimizer state and gradients", ZeroConfig(stage=2)),
    ("zero3", "ZeRO stage 3: shards optimizer state, gradients and parameters", ZeroConfig(stage=3)),
    ("zero2_offload", "ZeRO stage 2; fp32 master, gradients and optimizer state on the CPU, stepped there",
     ZeroConfig(stage=2, offload_optimizer="cpu")),
    ("zero3_offload", "ZeRO stage 3; optimizer side and parameter shards on the CPU",
     ZeroConfig(stage=3, offload_optimizer="cpu", offload_params="cpu")),
    ("zero3_offload_nvme", "ZeRO stage 3; optimizer state and parameter shards in files under nvme_path "
     "(or $LIGHTNING_ZERO_NVME_PATH)", ZeroConfig(stage=3, offload_optimizer="nvme", offload_params="nvme")),
    ("zero_auto", "ZeRO with the stage and offload placement planned at setup for the devices and model",
     ZeroConfig(auto_placement=True)),
)
