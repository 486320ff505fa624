"""``from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam`` keeps working after ``import lightning_zero as
deepspeed``: both build torch's Adam (``adam_w_mode=False``: L2 weight decay) or AdamW (the default: decoupled weight
decay), whose update the engine steps on its shards, on the GPU or, offloaded, with its host kernels. The knobs that
only choose DeepSpeed's kernels are accepted and ignored; one that changes the update torch cannot make
(``bias_correction=False``) is refused."""

from __future__ import annotations

from typing import Any

import torch

from ..engine.optim import UnsupportedOptimizerError

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]


class _AdamW(torch.optim.AdamW):
    pass


class _Adam(torch.optim.Adam):
    pass


def _build(name: str, params: Any, lr: float, bias_correction: bool, betas: tuple, eps: float, weight_decay: float,
           amsgrad: bool, decoupled: bool) -> torch.optim.Optimizer:
    if not bias_correction:
        raise UnsupportedOptimizerError(
            f"{name}(bias_correction=False): torch's Adam always corrects the moments' bias, so this update cannot be "
            f"made. Drop bias_correction=False (the update then differs only in the first steps).")
    cls = _AdamW if decoupled else _Adam
    return cls(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


class FusedAdam:
    """DeepSpeed's ``FusedAdam`` arguments; an instance of torch's AdamW (or Adam with ``adam_w_mode=False``)."""

    def __new__(cls, params: Any, lr: float = 1e-3, bias_correction: bool = True, betas: tuple = (0.9, 0.999),
                eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                set_grad_none: bool = True) -> Any:
        return _build("FusedAdam", params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode)


class DeepSpeedCPUAdam:
    """DeepSpeed's ``DeepSpeedCPUAdam`` arguments; an instance of torch's AdamW (or Adam with ``adamw_mode=False``).
    Where it steps is the strategy's choice (``offload_optimizer="cpu"``), not the optimizer's."""

    def __new__(cls, model_params: Any, lr: float = 1e-3, bias_correction: bool = True, betas: tuple = (0.9, 0.999),
                eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                fp32_optimizer_states: bool = True) -> Any:
        return _build("DeepSpeedCPUAdam", model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                      adamw_mode)
