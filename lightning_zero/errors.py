"""The errors that mean "your input is wrong" (a config value, a path, a checkpoint, an optimizer): front ends
(the command-line app, the tools) print their one-line message instead of a traceback. Each names the problem
and the fix; anything else is a bug and keeps its traceback."""

from __future__ import annotations

__all__ = ["user_errors"]


def user_errors() -> tuple[type[BaseException], ...]:
    from .checkpoint.files import CheckpointPathError
    from .collectives import MissingRanksError
    from .config import ZeroConfigError
    from .demo import DemoSettingError
    from .ds_config import DeepSpeedConfigError
    from .ds_schedules import UnsupportedScheduleError
    from .engine.flat_unit import ReplacedParameterError, ShardedParameterEditError
    from .engine.guard import ShardedStateDictError
    from .engine.optim import UnsupportedOptimizerError
    from .engine.state import CheckpointMismatchError
    from .engine.swap import NvmePathError
    from .host_memory import HostMemoryError
    from .precision.loss_scaler import LossScaleAtMinimumError

    return (ZeroConfigError, DeepSpeedConfigError, UnsupportedScheduleError, CheckpointPathError,
            CheckpointMismatchError, NvmePathError, UnsupportedOptimizerError, LossScaleAtMinimumError,
            MissingRanksError, ShardedStateDictError, HostMemoryError, DemoSettingError, ShardedParameterEditError,
            ReplacedParameterError)
