"""``lightning_zero.ops``: the optimizer names of ``deepspeed.ops`` that DeepSpeed scripts import, as torch's
optimizers (see :mod:`lightning_zero.ops.adam`)."""

from . import adam

__all__ = ["adam"]
