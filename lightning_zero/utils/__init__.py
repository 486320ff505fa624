"""``lightning_zero.utils``: DeepSpeed's ``deepspeed.utils`` tools under the same names."""

import logging

from . import zero_to_fp32
from .full_values import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
)

logger = logging.getLogger("lightning_zero")  # ``from deepspeed.utils import logger`` in scripts

__all__ = ["logger", "zero_to_fp32", "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_get_local_fp32_param", "safe_get_local_grad",
           "safe_get_local_optimizer_state"]
