"""DeepSpeed JSON → ZeroConfig (+ the Trainer settings DeepSpeed keeps in the same file).

``import_deepspeed_config(path_or_dict)`` returns :class:`DeepSpeedImport`: the ZeroConfig, the
precision, clipping, batch arithmetic, optimizer and scheduler specs, and the messages a user
coming from DeepSpeed needs: keys we map to nothing (one warning listing them), misspelled keys
(with the close match), legacy keys (``cpu_offload``), and contradictions. Contradictions that
would train differently from what the file says are errors; DeepSpeed's own "ignored" cases
(parameter offload below stage 3) are warnings naming the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from .config import ZeroConfig

__all__ = ["DeepSpeedConfigError", "DeepSpeedImport", "import_deepspeed_config", "check_batch", "resolve_batch"]


class DeepSpeedConfigError(ValueError):
    """The DeepSpeed configuration cannot be honoured as written."""


# Keys we understand, per section; the value says what they become (for the docs and the warnings).
ZERO_KEYS = {
    "stage": "stage", "offload_optimizer": "offload_optimizer/nvme_path/pin_memory/offload_fraction",
    "offload_param": "offload_params", "cpu_offload": "offload_optimizer='cpu' (legacy key)",
    "cpu_offload_params": "offload_params='cpu' (legacy key)", "cpu_offload_use_pin_memory": "pin_memory (legacy)",
    "overlap_comm": "overlap_comm", "reduce_bucket_size": "reduce_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold", "stage3_prefetch_bucket_size": "prefetch",
}
ZERO_UNMAPPED = {  # valid DeepSpeed keys with no lightning_zero counterpart, and why
    "contiguous_gradients": "gradients always live in contiguous buffers",
    "allgather_bucket_size": "stages 1/2 all-gather per unit",
    "allgather_partitions": "always on", "reduce_scatter": "always on",
    "stage3_max_live_parameters": "the gathered set is bounded by prefetch",
    "stage3_max_reuse_distance": "groups are freed after their backward",
    "sub_group_size": "the host steps chunks of 64M elements",
    "round_robin_gradients": "not needed", "elastic_checkpoint": "sharded checkpoints load on any world size",
    "stage3_gather_16bit_weights_on_model_save": "use checkpoint_format='full' or the consolidate tool",
    "stage3_gather_fp16_weights_on_model_save": "use checkpoint_format='full' or the consolidate tool",
    "ignore_unused_parameters": "unused parameters are always handled", "load_from_fp32_weights": "always",
    "memory_efficient_linear": "not needed", "zero_hpz_partition_size": "no hierarchical partitioning",
    "zero_quantized_weights": "no quantized communication", "zero_quantized_gradients": "no quantized communication",
    "mics_shard_size": "no MiCS", "use_multi_rank_bucket_allreduce": "not needed",
}
TOP_KEYS = {"zero_optimization", "fp16", "bf16", "gradient_clipping", "train_batch_size",
            "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
            "zero_allow_untested_optimizer", "lightning_zero"}
TOP_UNMAPPED = {"steps_per_print", "wall_clock_breakdown", "prescale_gradients", "gradient_predivide_factor",
                "dump_state", "tensorboard", "wandb", "csv_monitor", "flops_profiler", "activation_checkpointing",
                "communication_data_type", "seq_parallel_communication_data_type", "amp", "zero_force_ds_cpu_optimizer",
                "checkpoint", "data_types", "comms_logger", "autotuning", "elasticity", "compression_training",
                "sparse_gradients", "memory_breakdown", "aio", "timers"}
FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
             "auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"}
BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
             "bf16_optimizer_states"}
OFFLOAD_KEYS = {"device", "nvme_path", "pin_memory", "ratio", "buffer_count", "buffer_size", "fast_init",
                "max_in_cpu", "pipeline_read", "pipeline_write", "pipeline"}
OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad")


@dataclass
class DeepSpeedImport:
    """What a DeepSpeed configuration means here."""

    zero: ZeroConfig
    precision: Optional[str] = None  # "16-mixed", "bf16-mixed" or None (the file says nothing)
    gradient_clip_val: Optional[float] = None
    train_batch_size: Optional[int] = None
    micro_batch_per_gpu: Optional[int] = None
    accumulate: Optional[int] = None
    optimizer: Optional[dict[str, Any]] = None
    scheduler: Optional[dict[str, Any]] = None
    warnings: list[str] = field(default_factory=list)


def _load(source: Union[str, Path, dict]) -> dict[str, Any]:
    if isinstance(source, dict):
        return dict(source)
    if not isinstance(source, (str, Path)):
        raise DeepSpeedConfigError(f"A DeepSpeed config is the path of a ds_config.json or a dict, not "
                                   f"{type(source).__name__}.")
    path = Path(source).expanduser()
    if not path.is_file():
        raise DeepSpeedConfigError(f"DeepSpeed config '{path}' does not exist: pass the path of your ds_config.json "
                                   f"(or the dict itself).")
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DeepSpeedConfigError(f"DeepSpeed config '{path}' is not valid JSON: {err.msg} at line {err.lineno}, "
                                   f"column {err.colno}.") from None
    if not isinstance(loaded, dict):
        raise DeepSpeedConfigError(f"DeepSpeed config '{path}' holds a JSON {type(loaded).__name__}: it must be one "
                                   f"object of sections, {{\"zero_optimization\": {{...}}, ...}}.")
    return loaded


# Sections DeepSpeed reads as objects, with the shortest valid example. A bare value there ("fp16": true) would
# otherwise be read as "not enabled" and train in another precision without a word.
_OBJECTS = {"zero_optimization": '{"stage": 2}', "fp16": '{"enabled": true}', "bf16": '{"enabled": true}',
            "optimizer": '{"type": "AdamW", "params": {"lr": 1e-4}}', "optimizer.params": '{"lr": 1e-4}',
            "scheduler": '{"type": "WarmupLR", "params": {"warmup_num_steps": 100}}',
            "scheduler.params": '{"warmup_num_steps": 100}', "lightning_zero": '{"prefetch": 2}',
            "zero_optimization.offload_optimizer": '{"device": "cpu"}',
            "zero_optimization.offload_param": '{"device": "cpu"}'}


def _check_objects(ds: dict) -> None:
    for where, example in _OBJECTS.items():
        section: Any = ds
        for part in where.split("."):
            section = section.get(part) if isinstance(section, dict) else None
        if section is not None and not isinstance(section, dict):
            raise DeepSpeedConfigError(f"'{where}' must be a JSON object such as \"{where.split('.')[-1]}\": "
                                       f"{example}, not {json.dumps(section)}.")


def _legacy_bfloat16(ds: dict, notes: list[str]) -> None:
    """DeepSpeed still reads its old section name ``bfloat16`` (``bf16`` wins where both are given)."""
    if "bfloat16" not in ds:
        return
    legacy = ds.pop("bfloat16")
    if "bf16" in ds:
        notes.append("'bfloat16' is DeepSpeed's old name of 'bf16', which is also given and wins")
    else:
        ds["bf16"] = legacy
        notes.append("'bfloat16' is DeepSpeed's old name of 'bf16': read as 'bf16'")


def _unknown(keys: set[str], known: set[str], where: str, out: list[str]) -> None:
    for key in sorted(keys - known):
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
        hint = f" — did you mean '{close[0]}'?" if close else ""
        out.append(f"'{where}{key}' is not a DeepSpeed key and is ignored{hint}")


def _misspelt_switch(section: dict, switch: str, known: set[str], where: str, consequence: str) -> None:
    """A section without its switch key but with a key close to it: the switch was misspelt, and the section
    would silently mean the opposite of what it says."""
    if switch in section:
        return
    close = difflib.get_close_matches(switch, sorted(set(section) - known), n=1, cutoff=0.6)
    if close:
        raise DeepSpeedConfigError(f"'{where}.{close[0]}' is not a DeepSpeed key: did you mean '{where}.{switch}'? As "
                                   f"written the section {consequence}.")


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


# [Note: "auto" and typed values]
# Configs written for Hugging Face's Trainer are full of "auto", which that integration fills from the
# TrainingArguments and the model. Here a run's own settings fill them: the batch sizes, accumulation and
# clipping from the DataLoader and the Trainer (the keys are dropped: the Trainer's values stand, and are
# checked against the JSON where the JSON has numbers), fp16/bf16 from the Trainer's precision, the bucket and
# threshold sizes from our defaults (sized per model), a scheduler's warmup_max_lr from the optimizer's lr.
# Optimizer hyper-parameters and step counts have no source here: "auto" there is an error naming the key
# when that optimizer or scheduler is built (not when configure_optimizers builds its own). Booleans accept
# what DeepSpeed's own (pydantic) parser accepts ("true"/"false"/0/1...); numbers must be numbers.
_AUTO_FROM_RUN = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "gradient_clipping", "fp16.enabled", "bf16.enabled", "zero_optimization.reduce_bucket_size",
                  "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
                  "zero_optimization.allgather_bucket_size", "zero_optimization.sub_group_size",
                  "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance",
                  "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                  "zero_optimization.gather_16bit_weights_on_model_save"}
_AUTO_AT_BUILD = ("optimizer.params.", "scheduler.params.")
_BOOL_KEYS = {"fp16.enabled", "bf16.enabled", "zero_optimization.overlap_comm", "zero_optimization.cpu_offload",
              "zero_optimization.cpu_offload_params", "zero_optimization.cpu_offload_use_pin_memory",
              "zero_optimization.offload_optimizer.pin_memory", "zero_optimization.offload_param.pin_memory",
              "zero_optimization.contiguous_gradients", "zero_optimization.allgather_partitions",
              "zero_optimization.reduce_scatter", "zero_allow_untested_optimizer", "optimizer.params.torch_adam",
              "optimizer.params.adam_w_mode", "optimizer.params.bias_correction", "optimizer.params.amsgrad",
              "optimizer.params.nesterov", "wall_clock_breakdown", "prescale_gradients"}
_TRUE, _FALSE = {"true", "1", "yes", "on", "t", "y"}, {"false", "0", "no", "off", "f", "n"}


def as_bool(value: Any, where: str) -> bool:
    """A JSON flag as DeepSpeed's parser reads it; anything else is an error naming the key."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise DeepSpeedConfigError(f"{where}={value!r} is not a boolean: use true or false.")


def as_number(value: Any, where: str, kind: type = int) -> Any:
    """A JSON number (an integral float such as 5e8 for an int); strings and booleans are errors naming the key."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        hint = " ('auto' is filled from the run only where the README's DeepSpeed table says)" if value == "auto" else ""
        raise DeepSpeedConfigError(f"{where}={value!r} is not a number{hint}: give a number.")
    if kind is int:
        if float(value) != int(value):
            raise DeepSpeedConfigError(f"{where}={value!r} must be a whole number.")
        return int(value)
    return float(value)


def _normalize(ds: dict, notes: list[str], prefix: str = "") -> dict:
    """The config with "auto" resolved or dropped and flags read as booleans (see [Note: "auto" and typed values])."""
    out = {}
    for key, value in ds.items():
        where = f"{prefix}{key}"
        if isinstance(value, dict):
            out[key] = _normalize(value, notes, where + ".")
        elif isinstance(value, str) and value == "auto":
            if where in _AUTO_FROM_RUN:
                notes.append(f"{where}: 'auto' takes the run's own value")
                continue
            if where == "scheduler.params.warmup_min_lr":
                out[key] = 0.0
                continue
            if where.startswith(_AUTO_AT_BUILD):
                out[key] = value  # resolved or refused when the optimizer / scheduler is built
                continue
            raise DeepSpeedConfigError(f"{where} is 'auto', which only Hugging Face's Trainer can fill: give it a "
                                       f"value.")
        elif where in _BOOL_KEYS:
            out[key] = as_bool(value, where)
        else:
            out[key] = value
    return out


def import_deepspeed_config(source: Union[str, Path, dict], base: Optional[ZeroConfig] = None) -> DeepSpeedImport:
    """Map a DeepSpeed config (path or dict) onto ZeroConfig and Trainer settings."""
    notes: list[str] = []
    loaded = _load(source)
    _legacy_bfloat16(loaded, notes)
    _check_objects(loaded)
    ds = _normalize(loaded, notes)
    unmapped: list[str] = []
    by_lower = {k.lower(): k for k in TOP_KEYS}  # "FP16", "Bf16": DeepSpeed's keys are lower case
    for key in sorted(set(ds) - TOP_KEYS - TOP_UNMAPPED):  # a misspelt section would silently change the run
        close = [by_lower[k] for k in difflib.get_close_matches(key.lower(), sorted(by_lower), n=1, cutoff=0.75)]
        if close and close[0] not in ds:
            raise DeepSpeedConfigError(f"'{key}' is not a DeepSpeed key — did you mean '{close[0]}'? As written the "
                                       f"section would be ignored.")
    _unknown(set(ds), TOP_KEYS | TOP_UNMAPPED, "", notes)
    unmapped += sorted(k for k in ds if k in TOP_UNMAPPED)
    values: dict[str, Any] = {}
    zero = dict(ds.get("zero_optimization") or {})  # null: as absent
    _unknown(set(zero), set(ZERO_KEYS) | set(ZERO_UNMAPPED), "zero_optimization.", notes)
    unmapped += [f"zero_optimization.{k} ({ZERO_UNMAPPED[k]})" for k in sorted(zero) if k in ZERO_UNMAPPED]
    stage = as_number(zero.get("stage", 0), "zero_optimization.stage")
    if stage < 3 and any("did you mean 'offload_param'" in n for n in notes):
        notes.append(f"offload_param itself only applies to stage 3: under stage {stage} DeepSpeed keeps parameters "
                     f"on the GPU too")
    if stage == 0:  # DeepSpeed's default: plain data parallelism. ZeRO-1 trains the same model (see the note)
        notes.append("zero_optimization.stage is 0 (or missing): DeepSpeed's plain data parallelism runs here as ZeRO "
                     "stage 1, which trains the same model and shards the optimizer state"
                     + ("" if "zero_optimization" in ds else " (no 'zero_optimization' section in the config)"))
        stage = 1
    if stage not in (1, 2, 3):
        raise DeepSpeedConfigError(f"zero_optimization.stage={stage} is invalid: use 1, 2 or 3.")
    values["stage"] = stage
    for key, target in (("overlap_comm", "overlap_comm"), ("reduce_bucket_size", "reduce_bucket_size"),
                        ("stage3_param_persistence_threshold", "param_persistence_threshold")):
        if key in zero:
            kind = type(getattr(ZeroConfig, target))
            values[target] = zero[key] if kind is bool else as_number(zero[key], f"zero_optimization.{key}", kind)
    if "stage3_prefetch_bucket_size" in zero and as_number(zero["stage3_prefetch_bucket_size"],
                                                           "zero_optimization.stage3_prefetch_bucket_size") == 0:
        values["prefetch"] = 0
    _offload_optimizer(zero, values, notes)
    _offload_params(zero, stage, values, notes)
    precision = _precision(ds, values, notes)
    if ds.get("zero_allow_untested_optimizer"):
        values["allow_untested_optimizer"] = True
    values.update(_own_section(ds.get("lightning_zero")))
    config = (base or ZeroConfig()).replace(**values)
    out = DeepSpeedImport(zero=config, precision=precision, warnings=notes)
    clip = ds.get("gradient_clipping")
    out.gradient_clip_val = as_number(clip, "gradient_clipping", float) if clip is not None else None
    if out.gradient_clip_val is not None and out.gradient_clip_val < 0:
        raise DeepSpeedConfigError(f"gradient_clipping={clip} is negative: use 0 (off) or a positive norm.")
    out.gradient_clip_val = out.gradient_clip_val or None
    for key, attr in (("train_batch_size", "train_batch_size"), ("train_micro_batch_size_per_gpu", "micro_batch_per_gpu"),
                      ("gradient_accumulation_steps", "accumulate")):
        if ds.get(key) is not None:
            number = as_number(ds[key], key)
            if number < 1:
                raise DeepSpeedConfigError(f"{key}={ds[key]} must be 1 or more.")
            setattr(out, attr, number)
    out.optimizer = _optimizer(ds.get("optimizer"))
    out.scheduler = ds.get("scheduler")
    if out.scheduler is not None:
        from .ds_schedules import SCHEDULES, UnsupportedScheduleError, check_schedule_params

        if out.scheduler.get("type") not in SCHEDULES:
            raise UnsupportedScheduleError(f"DeepSpeed scheduler type {out.scheduler.get('type')!r} is not supported: "
                                           f"use one of {', '.join(SCHEDULES)}, or configure it in configure_optimizers.")
        check_schedule_params(out.scheduler["type"], out.scheduler.get("params") or {})
    if unmapped:
        notes.append("mapped to nothing here: " + ", ".join(unmapped))
    return out


def _own_section(section: Any) -> dict[str, Any]:
    """The config's ``"lightning_zero": {...}`` section: ZeroConfig fields DeepSpeed has no key for
    (``scheduler_on_skip``, ``prefetch``, ...), set in the same JSON; they win over the mapped keys."""
    if section is None:
        return {}
    fields = {f.name for f in dataclasses.fields(ZeroConfig)}
    if not isinstance(section, dict):
        raise DeepSpeedConfigError(f"'lightning_zero' must be an object of ZeroConfig fields, got {section!r}.")
    for key in section:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            raise DeepSpeedConfigError(f"lightning_zero.{key} is not a ZeroConfig field"
                                       + (f" — did you mean '{close[0]}'?" if close else "")
                                       + f" Fields: {', '.join(sorted(fields))}.")
    return dict(section)


def _offload_optimizer(zero: dict, values: dict, notes: list[str]) -> None:
    section = zero.get("offload_optimizer")
    if zero.get("cpu_offload"):
        given = section.get("device", "none") if isinstance(section, dict) else None
        if given not in (None, "cpu"):
            raise DeepSpeedConfigError(f"zero_optimization.cpu_offload=true (DeepSpeed's legacy key for "
                                       f"offload_optimizer.device='cpu') and offload_optimizer.device={given!r} "
                                       f"disagree: keep offload_optimizer alone.")
        notes.append("'zero_optimization.cpu_offload' is DeepSpeed's legacy key: read as offload_optimizer.device='cpu'")
        section = section or {"device": "cpu", **({"pin_memory": zero["cpu_offload_use_pin_memory"]}
                                                   if "cpu_offload_use_pin_memory" in zero else {})}
    if not isinstance(section, dict):
        return
    _misspelt_switch(section, "device", OFFLOAD_KEYS, "zero_optimization.offload_optimizer", "offloads nothing")
    _unknown(set(section), OFFLOAD_KEYS, "zero_optimization.offload_optimizer.", notes)
    device = section.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        raise DeepSpeedConfigError(f"zero_optimization.offload_optimizer.device={device!r} is invalid: use 'cpu', "
                                   f"'nvme' or 'none'.")
    values["offload_optimizer"] = device
    if "pin_memory" in section:
        values["pin_memory"] = bool(section["pin_memory"])
    if section.get("nvme_path"):
        values["nvme_path"] = str(section["nvme_path"])
    if "ratio" in section and device != "none":
        values["offload_fraction"] = as_number(section["ratio"], "zero_optimization.offload_optimizer.ratio", float)


def _offload_params(zero: dict, stage: int, values: dict, notes: list[str]) -> None:
    section = zero.get("offload_param")
    if zero.get("cpu_offload_params"):
        notes.append("'zero_optimization.cpu_offload_params' is DeepSpeed's legacy key: read as "
                     "offload_param.device='cpu'")
        section = section or {"device": "cpu"}
    if not isinstance(section, dict):
        return
    _misspelt_switch(section, "device", OFFLOAD_KEYS, "zero_optimization.offload_param", "offloads nothing")
    _unknown(set(section), OFFLOAD_KEYS, "zero_optimization.offload_param.", notes)
    device = section.get("device", "none")
    if device == "none":
        return
    if stage < 3:
        notes.append(f"zero_optimization.offload_param (device '{device}') only applies to stage 3, as in DeepSpeed, "
                     f"so parameters stay on the GPU; set stage 3 to offload them")
        return
    if values.get("offload_optimizer", "none") == "none":
        raise DeepSpeedConfigError("zero_optimization.offload_param is set without offload_optimizer: lightning_zero "
                                   "offloads parameters only together with the optimizer state (the fp32 master left "
                                   "on the GPU would cost more than the parameters free); add offload_optimizer.")
    values["offload_params"] = device
    if section.get("nvme_path") and "nvme_path" not in values:
        values["nvme_path"] = str(section["nvme_path"])


def _precision(ds: dict, values: dict, notes: list[str]) -> Optional[str]:
    fp16, bf16 = ds.get("fp16"), ds.get("bf16")
    if _enabled(fp16) and _enabled(bf16):
        raise DeepSpeedConfigError("Both fp16.enabled and bf16.enabled are true: choose one (bf16 needs no loss scaling).")
    for name, section, known in (("fp16", fp16, FP16_KEYS), ("bf16", bf16, BF16_KEYS)):
        if not isinstance(section, dict):
            continue
        _misspelt_switch(section, "enabled", known, name, f"does not turn {name} on: the run would train in fp32")
        _unknown(set(section), known, f"{name}.", notes)
    if _enabled(fp16):
        for key, target in (("loss_scale", "loss_scale"), ("initial_scale_power", "initial_scale_power"),
                            ("loss_scale_window", "loss_scale_window"), ("hysteresis", "hysteresis"),
                            ("min_loss_scale", "min_loss_scale")):
            if key in fp16:
                values[target] = as_number(fp16[key], f"fp16.{key}", type(getattr(ZeroConfig, target)))
        if "consecutive_hysteresis" in fp16:
            if not isinstance(fp16["consecutive_hysteresis"], bool):
                raise DeepSpeedConfigError(f"fp16.consecutive_hysteresis must be true or false, got "
                                           f"{fp16['consecutive_hysteresis']!r}.")
            values["consecutive_hysteresis"] = fp16["consecutive_hysteresis"]
        return "16-mixed"
    if _enabled(bf16):
        return "bf16-mixed"
    return None


def _optimizer(spec: Any) -> Optional[dict[str, Any]]:
    if spec is None:
        return None
    kind = spec.get("type", "")
    match = next((o for o in OPTIMIZERS if o.lower() == str(kind).lower()), None)
    if match is None:
        raise DeepSpeedConfigError(f"DeepSpeed optimizer type {kind!r} is not supported here: use one of "
                                   f"{', '.join(OPTIMIZERS)}, or build your optimizer in configure_optimizers.")
    return {"type": match, "params": dict(spec.get("params") or {})}


def build_optimizer(spec: dict[str, Any], params: Any) -> Any:
    """The torch optimizer for an imported ``optimizer`` spec, with DeepSpeed's semantics: "Adam" is AdamW
    unless ``adam_w_mode`` is false; without ``torch_adam`` DeepSpeed runs its fused Adam, whose
    ``weight_decay`` defaults to 0 (torch's AdamW: 0.01), so the default here is 0 as there;
    ``bias_correction`` (fused Adam's, on by default) is torch's only behaviour."""
    import torch

    p = dict(spec["params"])
    kind = spec["type"]
    autos = sorted(k for k, v in p.items() if v == "auto")
    if autos:
        raise DeepSpeedConfigError(f"optimizer.params.{autos[0]} is 'auto', which only Hugging Face's Trainer fills: give "
                                   f"it a value, or build the optimizer yourself (configure_optimizers, or "
                                   f"initialize(optimizer=...)).")
    if "max_grad_norm" in p:
        raise DeepSpeedConfigError("optimizer.params.max_grad_norm is not an optimizer setting (DeepSpeed refuses it "
                                   "too): use the top-level \"gradient_clipping\".")
    if kind in ("Adam", "AdamW"):
        adam_w = kind == "AdamW" or bool(p.pop("adam_w_mode", True))
        torch_adam = bool(p.pop("torch_adam", False))
        p.pop("adam_w_mode", None)
        kind = "AdamW" if adam_w else "Adam"
        if not torch_adam:
            p.setdefault("weight_decay", 0.0)
        if not p.pop("bias_correction", True):
            raise DeepSpeedConfigError("optimizer.params.bias_correction=false is not supported (torch's Adam always "
                                       "corrects the bias): remove it.")
        p.pop("set_grad_none", None)
        p.pop("fp32_optimizer_states", None)
    if "betas" in p:
        p["betas"] = tuple(p["betas"])
    try:
        return getattr(torch.optim, kind)(params, **p)
    except (TypeError, ValueError, IndexError) as err:  # torch's own check of a value ("Invalid learning rate"), a
        # betas list of one ("tuple index out of range"): the section and its values name what to fix
        raise DeepSpeedConfigError(f"DeepSpeed optimizer {spec['type']} with params {spec['params']} is refused by "
                                   f"torch.optim.{kind}: {err or type(err).__name__}. Fix the optimizer.params values "
                                   f"(betas takes two numbers, lr a positive number).") from None


def resolve_batch(tbs: Optional[int], mbs: Optional[int], gas: Optional[int], world: int
                  ) -> tuple[Optional[int], Optional[int], Optional[int]]:
    """(train_batch_size, micro-batch per rank, accumulation steps) with DeepSpeed's rules: any two give the third
    (a missing accumulation is 1 when only one size is given); all three must agree. None where nothing says."""
    def need(value: int, whole: int, part: int, name: str) -> int:
        if part <= 0 or whole % part:
            raise DeepSpeedConfigError(
                f"train_batch_size={tbs} cannot be split into {name} over world size {world} "
                f"(train_micro_batch_size_per_gpu={mbs}, gradient_accumulation_steps={gas}): choose sizes whose "
                f"product is train_batch_size.")
        return value

    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * world:
            raise DeepSpeedConfigError(
                f"train_batch_size={tbs} does not match train_micro_batch_size_per_gpu x gradient_accumulation_steps "
                f"x world size = {mbs} x {gas} x {world} = {mbs * gas * world}: fix one of them.")
        return tbs, mbs, gas
    if tbs is not None and mbs is not None:
        return tbs, mbs, need(tbs // (mbs * world), tbs, mbs * world, "micro-batches of " + str(mbs))
    if tbs is not None and gas is not None:
        return tbs, need(tbs // (gas * world), tbs, gas * world, f"{gas} accumulation steps"), gas
    if tbs is not None:
        return tbs, need(tbs // world, tbs, world, "equal micro-batches"), 1
    if mbs is not None:
        return mbs * (gas or 1) * world, mbs, gas or 1
    return None, None, gas


def check_batch(imported: DeepSpeedImport, micro_batch: Optional[int], world: int, accumulate: int) -> None:
    """train_batch_size = micro-batch x accumulation x world size, as DeepSpeed requires; one error shows it."""
    tbs, mb, acc = imported.train_batch_size, imported.micro_batch_per_gpu, imported.accumulate
    mb_here = micro_batch
    if mb is not None and mb_here is not None and mb != mb_here:
        raise DeepSpeedConfigError(f"train_micro_batch_size_per_gpu={mb} but the DataLoader's batch_size is {mb_here}: "
                                   f"make them equal.")
    mb = mb if mb is not None else mb_here
    if acc is not None and acc != accumulate:
        raise DeepSpeedConfigError(f"gradient_accumulation_steps={acc} but the Trainer accumulates {accumulate}: drop "
                                   f"accumulate_grad_batches from the Trainer (the JSON sets it) or make them equal.")
    if tbs is not None and mb is not None and tbs != mb * accumulate * world:
        raise DeepSpeedConfigError(
            f"train_batch_size={tbs} does not match train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
            f"world size = {mb} x {accumulate} x {world} = {mb * accumulate * world}: fix one of them (for this world "
            f"size and accumulation the micro-batch would be {tbs / (accumulate * world):g}).")
