"""The strategy names ``import lightning_zero`` registers with Lightning, and the config each one stands for."""

from __future__ import annotations

import difflib
from typing import Any, Optional

from .config import ZeroConfig, ZeroConfigError

__all__ = ["PRESETS", "preset_config", "as_config"]

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


def preset_config(name: str) -> ZeroConfig:
    """The config a strategy name stands for (``"zero3"``); an unknown name is one error with a close match."""
    for preset, _, config in PRESETS:
        if preset == name:
            return config
    names = [p for p, _, _ in PRESETS]
    close = difflib.get_close_matches(str(name), names, n=1)
    raise ZeroConfigError(f"Unknown strategy name {name!r}" + (f" — did you mean {close[0]!r}?" if close else "") +
                          f" Names: {', '.join(names)}.")


def as_config(config: Any) -> Optional[ZeroConfig]:
    """What ``ZeroStrategy(config=...)`` accepts: a ZeroConfig, a strategy name or a dict of ZeroConfig fields."""
    if config is None or isinstance(config, ZeroConfig):
        return config
    looks_deepspeed = (isinstance(config, str) and config.endswith(".json")) or hasattr(config, "__fspath__") or (
        isinstance(config, dict) and any(k in config for k in ("zero_optimization", "train_batch_size",
                                                               "train_micro_batch_size_per_gpu", "fp16", "bf16")))
    if looks_deepspeed:  # Lightning's DeepSpeedStrategy takes the JSON as config=
        raise ZeroConfigError(f"ZeroStrategy(config=...) got a DeepSpeed config ({str(config)[:80]}): pass it as "
                              f"ZeroStrategy(deepspeed_config=...) (a path or a dict; on the command line "
                              f"strategy=deepspeed strategy.deepspeed_config=PATH).")
    if isinstance(config, str):
        return preset_config(config)
    if isinstance(config, dict):
        return ZeroConfig.from_dict(config)
    raise ZeroConfigError(f"ZeroStrategy(config=...) takes a ZeroConfig, a strategy name ('zero3') or a dict of "
                          f"ZeroConfig fields; got {type(config).__name__}.")
