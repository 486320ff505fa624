"""``lightning_zero.utils``: DeepSpeed's ``deepspeed.utils`` tools under the same names."""

from . import zero_to_fp32

__all__ = ["zero_to_fp32"]
