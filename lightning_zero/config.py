"""ZeroConfig: the one typed description of a ZeRO run.

The strategy constructor, the Hydra schema (``conf/strategy/*.yaml`` holds exactly these
field names) and the DeepSpeed-JSON importer all produce this object. Code asks the derived
flags (``shard_grads``, ``shard_params``) instead of comparing ``stage`` numbers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

__all__ = ["ZeroConfig", "ZeroConfigError", "DTYPE_NAMES"]

# Names accepted wherever a dtype is configured; values are torch dtype attribute names.
PLACES = ("none", "cpu", "nvme")
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16", "half": "float16"}


class ZeroConfigError(ValueError):
    """A ZeroConfig field has a value that cannot work; the message names the field and the fix."""


@dataclass(frozen=True)
class ZeroConfig:
    """Settings of a ZeRO run. Every field is validated in ``__post_init__``.

    Args:
        stage: 1 shards optimizer state, 2 also gradients, 3 also parameters.
        reduce_bucket_size: elements per gradient bucket (stages 1/2). A bucket is also the
            unit that is sharded evenly across ranks, so it bounds the transient full-size
            gradient buffer a rank holds while a reduce-scatter is in flight.
        overlap_comm: launch each bucket's reduce-scatter as soon as its gradients are ready
            and let it run while backward continues; False waits for each one right after
            launching it (no overlap, same bounded memory: for debugging and timing).
        reduce_dtype: dtype gradients are communicated in ("fp32", "bf16", "fp16"); None
            keeps the dtype autograd produced (half the traffic in mixed precision).
        grad_accum_dtype: stage 1: dtype its full gradients accumulate in over the micro-batches
            of a window ("fp32", exact, by default; "bf16"/"fp16" halve that buffer). Stages 2/3
            always accumulate in their fp32 gradient shard.
        allow_untested_optimizer: step optimizers whose math is not known to be elementwise
            (their result on flat shards may differ from unsharded training).
        loss_scale: 0 selects dynamic loss scaling for fp16; a positive value is a static scale.
        initial_scale_power: the dynamic scale starts at 2**initial_scale_power.
        loss_scale_window: clean steps after which the dynamic scale doubles.
        hysteresis: overflows tolerated before the scale is halved (reset when the scale grows).
        consecutive_hysteresis: the tolerance is restored after every step without overflow (DeepSpeed's
            ``fp16.consecutive_hysteresis``): only consecutive overflows halve the scale.
        min_loss_scale: the scale never goes below this; an overflow at it is an error.
        wrap_modules: stage 3: class names of the modules that form one gathered group each
            (e.g. ``["Block"]``); empty selects groups by size (``min_group_params``).
        min_group_params: stage 3 size policy: a module subtree with at least this many
            parameters not yet grouped becomes a group.
        prefetch: stage 3: groups whose all-gather is issued ahead of use (0 disables).
        param_persistence_threshold: stage 3: groups with fewer elements stay gathered.
        real_init_bytes: stage 3, a model built in ``configure_model`` or under ``trainer.init_module()``: its
            first this-many bytes of parameters are built for real (exactly a normal build's values, whatever
            initializes them), the rest on the meta device, initialized from each module's
            ``reset_parameters()`` as its group is sharded, so no rank holds a large model whole. 0 (or
            ``init_module(empty_init=True)``) builds every parameter on the meta device. The default (4 MiB)
            builds small models exactly and keeps a large one's memory probe at its shard.
        activation_checkpointing: class names of modules to run under torch's non-reentrant
            activation checkpointing (recomputation re-gathers stage-3 groups).
        collective_timeout_s: seconds a rank waits in a collective before it fails with an
            error (instead of hanging when ranks disagree, e.g. uneven evaluation batches).
        rendezvous_timeout_s: seconds every rank waits for the others when entering a collective that user
            code calls (``full_state_dict``, ``save_checkpoint``, ...): a rank that never comes (a call under
            ``if trainer.is_global_zero:``) turns into an error naming it instead of a hang.
        scheduler_on_skip: fp16: what an LR scheduler stepped every optimizer step does when a step is skipped
            for overflow: "hold" (DeepSpeed's rule: the schedule follows the steps applied) or "advance"
            (Lightning's and torch AMP's: it follows the loop's steps).
        broadcast_buffers: before each training forward that synchronizes gradients, every rank
            takes rank 0's buffers (BatchNorm statistics), exactly as DDP does by default.
        checkpoint_format: "sharded" (default) writes a checkpoint directory in which every rank
            writes only its own part, readable by any world size and stage; "full" gathers one
            ordinary Lightning checkpoint file on rank 0 (for small models, or tools that need one file).
        offload_optimizer: where the fp32 master, the gradient shard and the optimizer state of the
            offloaded units live and are stepped: "none" (the device), "cpu" (host memory, stepped by
            the CPU) or "nvme" (files under ``nvme_path``, streamed through host staging buffers).
        offload_params: stage 3: where the parameter shards live between gathers ("none", "cpu",
            "nvme"); needs ``offload_optimizer`` (a master left on the GPU costs more than it saves).
        offload_fraction: share of the optimizer state (by bytes) that ``offload_optimizer`` moves;
            the rest stays on the device and steps there while the host steps its part.
        pin_memory: page-lock host buffers once at setup, so copies run asynchronously at full speed.
        nvme_path: directory for ``nvme`` offload files (a fast local disk); when null the
            LIGHTNING_ZERO_NVME_PATH environment variable is read.
        nvme_buffer_bytes: host memory budget of the staging buffers ``nvme`` offload streams through.
        overlap_step: offload: step host units during backward as soon as their gradients are final (one
            optimizer, automatic optimization, no hook that may change gradients before the step, such as an
            ``on_before_optimizer_step`` override); otherwise the host step follows backward.
        speculative_step: offload with ``overlap_step`` under gradient clipping or fp16 loss scaling: step host
            units during backward anyway, keeping a copy of their master and optimizer state (host memory as
            large as the offloaded state; skipped when the host has no room), and redo them after backward
            only when the global norm clips or a rank overflowed: bit-identical to stepping after backward.
            ``"auto"`` (default): the first steps run after backward and time it; speculation follows only
            when the copy is measured to take less time than the backward it hides (engine/speculation_trial).
        delayed_step: offload to the CPU: ZeRO-Offload's delayed parameter update (opt-in, inexact). From the
            second step on, step t's host update runs on a worker thread during forward and backward of step
            t+1, which still use the values of step t-1: the host step costs no time while it fits under them,
            and each update uses gradients one step stale. Costs a second host gradient buffer (4 bytes per
            offloaded parameter). Needs ``offload_optimizer="cpu"`` and parameters on the device (stage 3:
            ``offload_params="none"``).
        delayed_step_warmup: with ``delayed_step``: optimizer steps that run exactly (host step at the step) before
            the delayed update begins, counted from the start of each fit. A one-step-stale update hurts most
            while the loss falls fastest (ZeRO-Offload starts it after a few dozen steps); 0 delays from the
            second step (the first always runs at once: it creates the optimizer state).
        offload_accumulation: offload with gradient accumulation: where the offloaded units' gradients add up
            over the micro-batches of a window. "device" keeps an fp32 accumulator of them on the GPU and
            crosses PCIe once per step; "host" copies each micro-batch's reduced gradients down on a side
            stream and adds them on the host while the next micro-batch runs (no GPU memory for them:
            what lets the largest models accumulate).
        auto_placement: at setup, plan the stage and offload placement for the real devices and model
            (``strategy="zero_auto"``); the fields above are then chosen, not read.
    """

    stage: int = 2
    reduce_bucket_size: int = 6_250_000
    overlap_comm: bool = True
    reduce_dtype: Optional[str] = None
    grad_accum_dtype: Optional[str] = "fp32"
    allow_untested_optimizer: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    wrap_modules: tuple[str, ...] = ()
    min_group_params: int = 10_000_000
    prefetch: int = 1
    param_persistence_threshold: int = 100_000
    real_init_bytes: int = 2**22
    activation_checkpointing: tuple[str, ...] = ()
    collective_timeout_s: float = 1800.0
    rendezvous_timeout_s: float = 120.0
    scheduler_on_skip: str = "hold"
    broadcast_buffers: bool = True
    checkpoint_format: str = "sharded"
    offload_optimizer: str = "none"
    offload_params: str = "none"
    offload_fraction: float = 1.0
    pin_memory: bool = True
    nvme_path: Optional[str] = None
    nvme_buffer_bytes: int = 1 << 30
    overlap_step: bool = True
    speculative_step: Union[bool, str] = "auto"
    delayed_step: bool = False
    delayed_step_warmup: int = 0
    offload_accumulation: str = "device"
    auto_placement: bool = False

    def inert_settings(self) -> list[str]:
        """Settings given away from their defaults that this configuration never reads (a warning: nothing trains
        differently, but the user expected them to do something)."""
        default, out = ZeroConfig(), []
        if self.stage < 3 and not self.auto_placement:
            out += [f"{name} applies to stage 3 only (stage {self.stage} gathers no parameters)"
                    for name in ("wrap_modules", "prefetch", "param_persistence_threshold", "min_group_params")
                    if getattr(self, name) != getattr(default, name)]
        if self.delayed_step_warmup and not self.delayed_step:
            out.append("delayed_step_warmup applies with delayed_step=True only")
        if self.offload_accumulation != default.offload_accumulation and self.offload_optimizer == "none" \
                and not self.auto_placement:
            out.append("offload_accumulation applies with offload_optimizer only")
        return out

    def __post_init__(self) -> None:
        for name in ("wrap_modules", "activation_checkpointing"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, (str, type)) and v for v in value):
                raise ZeroConfigError(f"ZeroConfig.{name}={value!r} is invalid: give a list of module classes or "
                                      f"their names (e.g. [Block]).")
            object.__setattr__(self, name, tuple(_class_name(v) for v in value))
        for f in dataclasses.fields(self):
            _check_type(f.name, f.type, getattr(self, f.name))
        _check(self.stage in (1, 2, 3), "stage", self.stage, "use 1, 2 or 3 (zero1/zero2/zero3)")
        for name in ("reduce_bucket_size", "min_group_params"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0, name, value, "use a positive number of elements")
        for name in ("prefetch", "param_persistence_threshold", "initial_scale_power", "real_init_bytes"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 0, name, value, "use an integer >= 0")
        for name in ("reduce_dtype", "grad_accum_dtype"):
            value = getattr(self, name)
            _check(value is None or value in DTYPE_NAMES, name, value, f"use one of {sorted(set(DTYPE_NAMES))} or null")
        _check(self.loss_scale >= 0 and math.isfinite(self.loss_scale), "loss_scale", self.loss_scale,
               "use 0 (dynamic) or a positive, finite static scale")
        _check(isinstance(self.loss_scale_window, int) and self.loss_scale_window > 0, "loss_scale_window",
               self.loss_scale_window, "use a positive number of steps")
        _check(isinstance(self.hysteresis, int) and self.hysteresis >= 1, "hysteresis", self.hysteresis,
               "use an integer >= 1 (1 halves the scale at the first overflow)")
        _check(self.min_loss_scale > 0, "min_loss_scale", self.min_loss_scale, "use a positive scale")
        _check(self.initial_scale_power <= 64, "initial_scale_power", self.initial_scale_power,
               "use at most 64 (DeepSpeed's default is 16, a scale of 65536)")
        _check(self.min_loss_scale <= 2.0**self.initial_scale_power or self.loss_scale > 0, "min_loss_scale",
               self.min_loss_scale, "keep it at or below 2**initial_scale_power")
        _check(self.checkpoint_format in ("sharded", "full"), "checkpoint_format", self.checkpoint_format,
               "use 'sharded' (a directory, every rank writes its part) or 'full' (one file from rank 0)")
        _check(self.scheduler_on_skip in ("hold", "advance"), "scheduler_on_skip", self.scheduler_on_skip,
               "use 'hold' (a step skipped for fp16 overflow does not advance the LR schedule, as DeepSpeed) or "
               "'advance' (it does, as Lightning's AMP)")
        for name in ("offload_optimizer", "offload_params"):
            _check(getattr(self, name) in PLACES, name, getattr(self, name), "use 'none', 'cpu' or 'nvme'")
        _check(self.offload_params == "none" or self.stage == 3, "offload_params", self.offload_params,
               "parameters are sharded only in stage 3: use stage=3 (zero3_offload), or offload_optimizer alone "
               "with stage 1/2 (zero2_offload)")
        _check(self.offload_params == "none" or self.offload_optimizer != "none", "offload_params",
               self.offload_params, "also set offload_optimizer='cpu' or 'nvme': the fp32 master left on the GPU "
               "would take twice the memory the 16-bit parameters free")
        _check(0.0 <= self.offload_fraction <= 1.0, "offload_fraction", self.offload_fraction,
               "use a share between 0.0 (all on the device) and 1.0 (all offloaded)")
        _check(self.offload_fraction == 1.0 or self.offload_optimizer != "none", "offload_fraction",
               self.offload_fraction, "a partial placement needs offload_optimizer='cpu' or 'nvme'")
        _check(self.offload_accumulation in ("device", "host"), "offload_accumulation", self.offload_accumulation,
               "use 'device' (an fp32 accumulator on the GPU) or 'host' (micro-batch gradients added on the host)")
        _check(not self.delayed_step or self.auto_placement or self.offload_optimizer == "cpu", "delayed_step",
               self.delayed_step, "the delayed host step needs offload_optimizer='cpu' (zero2_offload or zero3_offload "
               "with offload_params='none'); NVMe-offloaded state is stepped from files after backward")
        _check(not self.delayed_step or self.offload_params == "none", "delayed_step", self.delayed_step,
               "the delayed host step updates the host copy stage-3 gathers read during the next forward: keep "
               "the parameters on the device (offload_params='none') or set delayed_step=False")
        _check(isinstance(self.delayed_step_warmup, int) and self.delayed_step_warmup >= 0, "delayed_step_warmup",
               self.delayed_step_warmup, "use a whole number of optimizer steps, 0 or more")
        _check(self.speculative_step in (True, False, "auto"), "speculative_step", self.speculative_step,
               "use true (always speculate), false (step after backward) or 'auto' (decided from the first steps)")
        _check(self.nvme_buffer_bytes >= 4096, "nvme_buffer_bytes", self.nvme_buffer_bytes,
               "use a positive number of bytes, at least 4096 (the host staging budget of NVMe offload)")
        _check(self.collective_timeout_s > 0, "collective_timeout_s", self.collective_timeout_s,
               "use a positive number of seconds")
        _check(self.rendezvous_timeout_s > 0, "rendezvous_timeout_s", self.rendezvous_timeout_s,
               "use a positive number of seconds")

    # Derived flags: the stage is a policy, read through these.
    @property
    def shard_optimizer(self) -> bool:
        return True

    @property
    def shard_grads(self) -> bool:
        return self.stage >= 2

    @property
    def shard_params(self) -> bool:
        return self.stage >= 3

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer != "none" and self.offload_fraction > 0

    def replace(self, **changes: Any) -> ZeroConfig:
        """A copy with ``changes`` applied (validated like a new config)."""
        _reject_unknown(changes)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ZeroConfig:
        """Build from a plain mapping (a Hydra node, a YAML file); unknown keys are an error."""
        values = dict(values)
        values.pop("_target_", None)
        _reject_unknown(values)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) }


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(ZeroConfig) ]


def _named_keywords(init: Any) -> Any:
    """``ZeroConfig(stgae=3)``: ZeroConfig's one-line message with the close match, not Python's TypeError."""
    def __init__(self: ZeroConfig, *args: Any, **kwargs: Any) -> None:
        _reject_unknown(kwargs)
        init(self, *args, **kwargs)
    __init__.__doc__, __init__.__wrapped__ = init.__doc__, init  # type: ignore[attr-defined]
    return __init__


ZeroConfig.__init__ = _named_keywords(ZeroConfig.__init__)  # type: ignore[method-assign]


def _reject_unknown(values: dict[str, Any]) -> None:
    import difflib

    known = field_names()
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ZeroConfigError(f"Unknown ZeroConfig option '{key}'.{hint} Valid options: {', '.join(known)}.")


_TYPES = {"Union[bool, str]": (bool, str), "str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "Optional[str]": (str, type(None)),
          "tuple[str, ...]": (tuple,)}


def _check_type(name: str, annotation: str, value: Any) -> None:
    allowed = _TYPES[annotation]
    ok = isinstance(value, allowed) and (bool in allowed or not isinstance(value, bool))
    if not ok:
        expected = annotation.replace("Union[bool, str]", "true, false or 'auto'").replace("Optional[str]", "a string or null").replace("tuple[str, ...]", "a list of names")
        raise ZeroConfigError(f"ZeroConfig.{name}={value!r} has type {type(value).__name__}: expected {expected}.")


def _class_name(value: Any) -> str:
    return value if isinstance(value, str) else getattr(value, "__name__", str(value))


def _check(ok: bool, name: str, value: Any, fix: str) -> None:
    if not ok:
        raise ZeroConfigError(f"ZeroConfig.{name}={value!r} is invalid: {fix}.")
