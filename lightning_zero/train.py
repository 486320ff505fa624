"""The command-line entry point: ``python -m lightning_zero.train [hydra overrides]``.

Trains the demo GPT (``lightning_zero/demo/gpt.py``) on the embedded character corpus
(``lightning_zero/demo/data.py``) under a ZeRO strategy, all configured from the ``conf/`` groups::

    python -m lightning_zero.train                                   # zero2, tiny GPT, 2 CPU ranks or all GPUs
    python -m lightning_zero.train strategy=zero1 trainer.devices=2 trainer.precision=bf16-mixed \\
        strategy.reduce_bucket_size=1000000 trainer.max_steps=20

The ``strategy`` node holds exactly the fields of :class:`~lightning_zero.config.ZeroConfig` (the
YAMLs are generated from it, see :func:`write_strategy_yamls`, and a structured schema built from it
type-checks every override); the strategy is built from that node through ``ZeroConfig.from_dict``.

This is the only module of the package that imports Hydra/OmegaConf.

[Note: Lightning's launcher and Hydra] With ``devices > 1`` Lightning's subprocess launcher
re-runs ``python -m lightning_zero.train <same argv>`` once per extra rank, adding
``hydra.run.dir=<rank 0's dir>`` (so every rank writes under one output directory) and
``hydra.output_subdir=null`` (so only rank 0 saves the composed config). The children compose
the same config from the same argv, hence build the same strategy. ``hydra.job.chdir`` stays
false so relative paths resolve as typed.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import sys
import typing
from pathlib import Path
from typing import Any, Optional

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

from lightning_zero.config import ZeroConfig, ZeroConfigError, field_names

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
_IN_CHECKOUT = (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "conf" / "config.yaml").is_file()
# A checkout (or editable install) reads conf/ in place; a wheel carries it inside the package
# (lightning_zero/conf: see pyproject's package-dir). The model and data are lightning_zero.demo.
CONF_DIR = REPO_ROOT / "conf" if _IN_CHECKOUT else PACKAGE_DIR / "conf"

__all__ = ["main", "run", "build_strategy", "resolve_devices", "check_overrides", "zero_schema",
           "register_schema", "strategy_options", "strategy_yaml", "write_strategy_yamls"]

log = logging.getLogger("lightning_zero.train")

SCHEMA_NAME = "_zero_schema"  # strategy/<this> in the ConfigStore; each strategy YAML extends it


# ---- the strategy node: one source of truth --------------------------------------------------------
def zero_schema() -> type:
    """A mutable dataclass mirroring :class:`ZeroConfig` field for field, for Hydra's ConfigStore.

    ZeroConfig itself is frozen, which OmegaConf turns into a read-only node that overrides could not
    change; the mirror has the same names, types and defaults, and no validation (ZeroConfig does that).
    """
    hints = typing.get_type_hints(ZeroConfig)
    fields = [(f.name, hints[f.name], dataclasses.field(default=f.default)) for f in dataclasses.fields(ZeroConfig)]
    fields.append(("deepspeed_config", Optional[str], dataclasses.field(default=None)))  # a ds_config.json path
    return dataclasses.make_dataclass("ZeroConfigSchema", fields)


def register_schema() -> None:
    """Store the schema as ``strategy/_zero_schema`` (idempotent: the ConfigStore overwrites)."""
    ConfigStore.instance().store(group="strategy", name=SCHEMA_NAME, node=zero_schema())


def strategy_yaml(stage: int, config: Optional[ZeroConfig] = None, title: str = "") -> str:
    """The text of ``conf/strategy/<name>.yaml``: ZeroConfig's defaults with that stage (or ``config``)."""
    body = OmegaConf.to_yaml(OmegaConf.create((config or ZeroConfig(stage=stage)).to_dict()))
    return (f"# {title or f'ZeRO stage {stage}'}. Generated from lightning_zero.config.ZeroConfig (field docs\n"
            f"# there) by lightning_zero.train.write_strategy_yamls(); regenerate instead of editing by hand.\n"
            f"defaults:\n  - {SCHEMA_NAME}\n  - _self_\n\n{body}")


def write_strategy_yamls(directory: Path = CONF_DIR / "strategy") -> None:
    from lightning_zero.presets import PRESETS

    for stage in (1, 2, 3):
        (directory / f"zero{stage}.yaml").write_text(strategy_yaml(stage))
    for name, description, config in PRESETS[3:]:
        (directory / f"{name}.yaml").write_text(strategy_yaml(config.stage, config, description))
    (directory / "deepspeed.yaml").write_text(
        "# A DeepSpeed ds_config.json read by lightning_zero: strategy=deepspeed strategy.deepspeed_config=PATH.\n"
        "# The JSON's zero_optimization/fp16/bf16/clipping/batch/optimizer/scheduler win over the defaults here, not over\n"
        "# strategy.KEY=... typed on the command line.\n"
        f"defaults:\n  - {SCHEMA_NAME}\n  - _self_\n\ndeepspeed_config: ???\n")


def check_overrides(overrides: list[str]) -> None:
    """Reject ``strategy.<key>=...`` overrides whose key is not a ZeroConfig field.

    Runs before Hydra composes, so a typo gives ZeroConfig's one-line message (naming the key, a
    close match and the valid options) instead of Hydra's multi-line composition error.
    """
    unknown = []
    typed = []
    for arg in overrides:
        if arg.startswith("-") or "=" not in arg:
            continue  # Hydra's own flags (--cfg, -m, ...)
        key = arg.split("=", 1)[0].lstrip("+~")
        if (CONF_DIR / key).is_dir():
            _check_group_choice(key, arg.split("=", 1)[1])
        _check_app_key(key, arg.split("=", 1)[1])
        if key.startswith("strategy."):
            name = key.split(".")[1]
            if name not in field_names() and name != "deepspeed_config":
                unknown.append(name)
            else:
                typed.append(arg)
    if unknown:
        ZeroConfig.from_dict(dict.fromkeys(unknown))  # raises ZeroConfigError for the first unknown key
    for arg in typed:
        _check_override_type(arg)


def _check_app_key(key: str, value: str) -> None:
    """A key nothing reads (``+zero.stage=3``, ``trainer.max_step=5``) or a whole number that is not one: one line
    naming it (Hydra would add the first silently, and the others fail deep in the job)."""
    top = OmegaConf.load(CONF_DIR / "config.yaml")
    known = {k for k in top if k != "defaults"} | {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    head = key.split(".", 1)[0]
    if head not in known:
        close = difflib.get_close_matches(head, sorted(known), n=1)
        raise ZeroConfigError(f"'{key}' is not a setting of this app" + (f" — did you mean '{close[0]}'?" if close else ".")
                              + f" Top-level settings: {', '.join(sorted(known - {'hydra'}))}.")
    if head == "trainer" and "." in key:
        import inspect

        name = key.split(".")[1]
        accepted = sorted(inspect.signature(pl.Trainer.__init__).parameters.keys() - {"self"})
        if name not in accepted:
            close = difflib.get_close_matches(name, accepted, n=1)
            raise ZeroConfigError(f"trainer.{name} is not an argument of Lightning's Trainer"
                                  + (f" — did you mean 'trainer.{close[0]}'?" if close else "."))
    if "." not in key and isinstance(top.get(key), int) and not isinstance(top.get(key), bool) \
            and not any(c in value for c in "()*[]{}$,") and value.strip() not in ("null",):
        try:
            int(value)
        except ValueError:
            raise ZeroConfigError(f"{key}={value} is not a whole number.") from None


def _check_group_choice(group: str, value: str) -> None:
    """``strategy=zero9``: one line naming the options (Hydra's message spans many and lists the internal schema)."""
    if any(c in value for c in "()*[]{}$"):
        return  # a sweep function or interpolation: Hydra resolves it
    options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    for choice in filter(None, value.split(",")):  # a comma list is a --multirun sweep
        if choice not in options:
            close = difflib.get_close_matches(choice, options, n=1)
            raise ZeroConfigError(f"{group}={choice} is not an option of '{group}'"
                                  + (f" — did you mean '{close[0]}'?" if close else ".")
                                  + f" Options: {', '.join(options)}.")


def _check_override_type(arg: str) -> None:
    """The value's type against the strategy schema, as Hydra will check it, but as one ZeroConfigError line
    (Hydra's own message spans several lines). Values of the right type are validated later by ZeroConfig."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf.errors import OmegaConfBaseException

    try:
        override = OverridesParser.create().parse_overrides([arg])[0]
    except Exception:  # noqa: BLE001 - a grammar error: Hydra's own message names it
        return
    name = override.key_or_group.split(".")[1]
    if override.is_sweep_override() or override.is_delete():
        return
    try:
        OmegaConf.merge(OmegaConf.structured(zero_schema()), {name: override.value()})
    except OmegaConfBaseException as err:
        first = str(err).strip().splitlines()[0]
        raise ZeroConfigError(f"strategy.{name}={override.get_value_element_as_str()}: {first}") from None


def strategy_options(node: Any) -> tuple[ZeroConfig, Optional[str]]:
    """The composed ``strategy`` node as (validated ZeroConfig, DeepSpeed JSON path or None)."""
    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    deepspeed = values.pop("deepspeed_config", None)
    if deepspeed == "???":  # strategy=deepspeed marks it mandatory
        from lightning_zero.ds_config import DeepSpeedConfigError

        raise DeepSpeedConfigError("strategy=deepspeed needs strategy.deepspeed_config=PATH (a ds_config.json, e.g. "
                                   "examples/ds_config_tiny.json).")
    return ZeroConfig.from_dict(values), deepspeed


# What a preset is: named on the command line beside a DeepSpeed JSON (strategy=zero3 strategy.deepspeed_config=...),
# these stay the preset's; the JSON fills the rest.
PRESET_FIELDS = ("stage", "offload_optimizer", "offload_params", "auto_placement")


def build_strategy(node: Any, explicit: frozenset = frozenset(), chosen: Optional[str] = None) -> Any:
    """``ZeroStrategy`` from the composed ``strategy`` node (through ZeroConfig, which validates it). With a DeepSpeed
    JSON, the JSON wins over the YAML's defaults but not over what the user chose: ``strategy.KEY=...`` typed on the
    command line (``explicit``) and the fields of a preset named there (``chosen``)."""
    from lightning_zero import ZeroStrategy

    config, deepspeed = strategy_options(node)
    options: dict[str, Any] = {}
    if deepspeed is not None:
        named = [f for f in PRESET_FIELDS if chosen not in (None, "deepspeed")]
        typed = [key.split(".", 1)[1] for key in explicit
                 if key.startswith("strategy.") and key.split(".", 1)[1] in field_names()]
        options = {name: getattr(config, name) for name in (*named, *typed)}
    return ZeroStrategy(config=config, deepspeed_config=deepspeed, **options)


# ---- devices ---------------------------------------------------------------------------------------
def resolve_devices(accelerator: str, devices: Any, cpu_devices: int) -> tuple[str, Any]:
    """Turn ``accelerator: auto`` / ``devices: auto`` into what the run uses.

    ``auto`` means all GPUs when CUDA is available, else ``cpu_devices`` CPU processes over gloo
    (Lightning's own ``auto`` would give one CPU process, which shards nothing). Other accelerators
    such as MPS are not auto-selected: the ZeRO collectives need NCCL or gloo.
    """
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if devices == "auto":
        devices = torch.cuda.device_count() if accelerator in ("gpu", "cuda") else cpu_devices
    return accelerator, devices


def _limit_cpu_threads(accelerator: str, devices: Any) -> None:
    """Give each CPU rank its share of the cores: N ranks x all-cores threads thrash."""
    if accelerator == "cpu" and isinstance(devices, int) and devices > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))


# ---- callbacks -------------------------------------------------------------------------------------
class RunSummary(Callback):
    """Rank 0 logs one line per validation and one at the end of training: loss, throughput, MFU.

    Live progress is Lightning's own progress bar; throughput is Lightning's ``ThroughputMonitor``
    (logged to the logger as ``train/device/items_per_sec`` = tokens/s per device, ``train/items_per_sec``
    over all ranks, ``train/device/mfu`` where the GPU's peak FLOPs are known); this line repeats the
    last of them so a log file or a CI job shows the result without opening the metrics.
    """

    def __init__(self, resumed_from: Optional[str] = None) -> None:
        self.resumed_from, self.resumed_at = resumed_from, 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.resumed_at = trainer.global_step

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = trainer.callback_metrics
        if trainer.is_global_zero and not trainer.sanity_checking and "val/loss" in metrics:
            log.info("step %5d  val/loss %.4f  val/ppl %.2f", trainer.global_step, float(metrics["val/loss"]),
                     float(metrics.get("val/ppl", float("nan"))))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            resumed = (f"  resumed from {self.resumed_from} at step {self.resumed_at}" if self.resumed_from else "")
            log.info("%s%s", summary_line(trainer), resumed)


def summary_line(trainer: pl.Trainer) -> str:
    metrics = {**trainer.callback_metrics, **trainer.logged_metrics}
    total = int(trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches)
    parts = [f"finished step {trainer.global_step}/{total}"]
    for key in ("train/loss", "val/loss"):
        if key in metrics:
            parts.append(f"{key} {float(metrics[key]):.4f}")
    def throughput(name: str) -> Any:  # ThroughputMonitor's separator is "/" (older Lightning: "|")
        return next((metrics[f"train{sep}{name}"] for sep in "/|" if f"train{sep}{name}" in metrics), None)

    tokens = throughput("items_per_sec")  # all ranks (a single process logs only the device figure)
    tokens = tokens if tokens is not None else throughput("device/items_per_sec")
    # ThroughputMonitor logs every log_every_n_steps once its window is full: a shorter run has none
    parts.append(f"tokens/s {float(tokens):,.0f}" if tokens is not None else "tokens/s n/a (run too short)")
    mfu = throughput("device/mfu")
    parts.append(f"MFU {float(mfu):.1%}" if mfu is not None else "MFU n/a (peak FLOPs unknown for this device)")
    return "  ".join(parts)


def throughput_monitor(window: int) -> Callback:
    """Lightning's ThroughputMonitor counting tokens (batches are ``(ids, targets)`` of shape (B, T))."""
    from lightning.pytorch.callbacks import ThroughputMonitor

    return ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0], length_fn=lambda batch: batch[0].numel(),
                             window_size=max(2, window))


def pytorch_profiler(directory: Path) -> Any:
    """Lightning's PyTorchProfiler writing a Chrome/Perfetto trace per rank under ``directory``.

    Threads other than the main one are recorded too where torch allows it: the offloaded
    optimizer step runs on a worker thread (``zero/host_step_in_backward``).
    """
    from lightning.pytorch.profilers import PyTorchProfiler

    kwargs: dict[str, Any] = {}
    try:
        kwargs["experimental_config"] = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # older torch: main-thread labels only
        pass
    return PyTorchProfiler(dirpath=directory, filename="trace", export_to_chrome=True, **kwargs)


class MemoryReportPrinter(Callback):
    """Reads ``strategy.memory_report()`` at the end of training, while the engine still exists
    (the strategy's teardown hands the module back as plain parameters); rank 0 logs it."""

    def __init__(self) -> None:
        self.report: Optional[Any] = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report_fn = getattr(trainer.strategy, "memory_report", None)
        if report_fn is None:
            return  # a non-ZeRO strategy (e.g. ddp) in an experiment
        self.report = report_fn()
        if trainer.is_global_zero:
            log.info("\n%s", self.report.format())


# ---- resuming and the DeepSpeed JSON's say ------------------------------------------------------------
def resolve_ckpt_path(value: Optional[str], output_dir: Path) -> Optional[str]:
    """``ckpt_path=PATH`` (a sharded directory or a file, ours or DeepSpeed's) or ``ckpt_path=last``: the newest
    checkpoint any earlier run of the app wrote under its outputs root (``hydra.run.dir``'s parent's parent)."""
    if value in (None, "", "null"):
        return None
    from lightning_zero.checkpoint.files import CheckpointPathError

    if value == "last":
        root = output_dir.parent.parent
        found = [p for p in root.glob("*/*/**/*.ckpt") if not p.name.endswith((".partial", ".old"))
                 and output_dir not in p.parents]
        if not found:
            raise CheckpointPathError(f"ckpt_path=last: no checkpoint under {root}. Train with "
                                      f"trainer.enable_checkpointing=true first, or give ckpt_path=PATH.")
        return str(max(found, key=lambda p: p.stat().st_mtime))
    if not Path(value).exists():
        raise CheckpointPathError(f"ckpt_path={value}: no such file or directory (relative paths start at "
                                  f"{os.getcwd()}).")
    return value


def _explicit_overrides() -> set[str]:
    """The keys set on the command line (defaults of the app's YAML are not the user's explicit choice)."""
    if not HydraConfig.initialized():
        return set()
    return {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}


def _defer_to_deepspeed_json(strategy: Any, trainer_cfg: dict, explicit: set[str]) -> None:
    """The JSON's gradient_clipping / gradient_accumulation_steps win over the app's defaults (not over a value
    typed on the command line: that conflict stays an error naming both)."""
    ds = getattr(strategy, "deepspeed", None)
    if ds is None:
        return
    if ds.gradient_clip_val is not None and "trainer.gradient_clip_val" not in explicit:
        trainer_cfg["gradient_clip_val"] = None
    if ds.accumulate is not None and "trainer.accumulate_grad_batches" not in explicit:
        trainer_cfg["accumulate_grad_batches"] = 1


def _is_rank_zero() -> bool:
    return all(int(os.environ.get(k, "0") or 0) == 0 for k in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def _app_message(err: BaseException) -> str:
    """The error's one line, in the app's terms (its Hydra keys)."""
    text = " ".join(str(err).split())
    return text.replace("the DataLoader's batch_size", "the DataLoader's batch_size (data.batch_size)")


# ---- the job ---------------------------------------------------------------------------------------
def _output_dir() -> str:
    return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else os.getcwd()


def run(cfg: DictConfig) -> dict[str, float]:
    """Train as ``cfg`` says; returns rank 0's final ``callback_metrics`` as floats."""
    import lightning_zero  # noqa: F401  (registers zero1/2/3 in every rank, children included)

    pl.seed_everything(cfg.seed, workers=True)
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    accelerator, devices = resolve_devices(trainer_cfg.pop("accelerator"), trainer_cfg.pop("devices"),
                                           cfg.cpu_devices)
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), Path(_output_dir()))
    chosen = HydraConfig.get().runtime.choices.get("strategy") if HydraConfig.initialized() else None
    if chosen == "deepspeed" and cfg.strategy.get("deepspeed_config") is None:  # the schema's None hides `???`
        strategy_options({"deepspeed_config": "???"})  # raises: names strategy.deepspeed_config
    strategy = build_strategy(cfg.strategy, frozenset(_explicit_overrides()), chosen)
    _defer_to_deepspeed_json(strategy, trainer_cfg, _explicit_overrides())
    _limit_cpu_threads(accelerator, devices)

    if trainer_cfg.get("logger") is True:  # a fixed choice (Lightning's default depends on what is installed)
        trainer_cfg["logger"] = CSVLogger(_output_dir(), name="logs")

    trace_dir = None
    if trainer_cfg.get("profiler") == "pytorch":  # ours: a trace file per rank, in a known place
        trace_dir = Path(_output_dir()) / "profile"
        trainer_cfg["profiler"] = pytorch_profiler(trace_dir)

    datamodule = _instantiate(cfg.data)
    model = _instantiate(cfg.model, vocab_size=datamodule.vocab_size)
    memory = MemoryReportPrinter()
    callbacks: list[Callback] = [RunSummary(ckpt_path), memory, throughput_monitor(cfg.throughput_window)]
    if trainer_cfg.get("enable_progress_bar", True):
        from lightning.pytorch.callbacks import TQDMProgressBar

        callbacks.append(TQDMProgressBar(refresh_rate=cfg.progress_every))
    trainer = pl.Trainer(accelerator=accelerator, devices=devices, strategy=strategy,
                         callbacks=callbacks, default_root_dir=_output_dir(), **trainer_cfg)
    if trainer.is_global_zero:
        log.info("%s", datamodule.describe())
        log.info("strategy %s on %s x %s, precision %s", trainer.strategy.config, accelerator, devices,
                 trainer.precision)
    if ckpt_path is not None and trainer.is_global_zero:
        log.info("resuming from %s", ckpt_path)
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    if trace_dir is not None and trainer.is_global_zero:
        traces = sorted(str(p) for p in trace_dir.glob("*.json"))
        log.info("profiler trace: %s (open in https://ui.perfetto.dev or chrome://tracing; the zero/* ranges are "
                 "the collectives, gathers, offload copies and optimizer steps)", ", ".join(traces) or
                 f"none written under {trace_dir} (fewer than 5 training steps?)")

    if cfg.sample_chars > 0 and model.model is not None:
        sampler = model
        if getattr(trainer.strategy, "config", None) is not None and trainer.strategy.config.shard_params:
            # stage 3 keeps the module sharded after fit: rank 0 samples from a plain copy
            state = trainer.strategy.full_state_dict()  # every rank takes part; rank 0 receives it
            if trainer.is_global_zero:
                sampler = instantiate(cfg.model, vocab_size=datamodule.vocab_size)
                sampler.configure_model()
                sampler.load_state_dict(state)
        if trainer.is_global_zero:
            _log_sample(sampler, datamodule, cfg.sample_chars, cfg.seed)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def _instantiate(node: Any, **kwargs: Any) -> Any:
    """Hydra wraps a constructor's error in its own: a wrong setting (DemoSettingError) is raised as itself, to be
    printed as one line."""
    from hydra.errors import InstantiationException

    from lightning_zero.errors import user_errors

    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, user_errors()):
            raise err.__cause__ from None
        raise


def _log_sample(model: Any, datamodule: Any, n_chars: int, seed: int) -> None:
    """Rank 0 only, after fit, on a module holding full parameters."""
    tokenizer = datamodule.tokenizer
    start = torch.tensor([tokenizer.encode("The ").tolist()], device=model.device)
    out = model.generate(start, n_chars, temperature=0.8, top_k=20, generator=_generator(model.device, seed))
    log.info("sample:\n%s", tokenizer.decode(out[0]))


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    from lightning_zero.errors import user_errors

    try:
        run(cfg)
    except user_errors() as err:  # the input is wrong: one line on rank 0, exit 2 (HYDRA_FULL_ERROR=1: traceback)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if _is_rank_zero():
            print(f"error: {_app_message(err)}", file=sys.stderr, flush=True)
        sys.exit(2)


register_schema()

def cli() -> None:
    """``lightning-zero-train`` (console script) and ``python -m lightning_zero.train``."""
    try:
        check_overrides(sys.argv[1:])
    except ZeroConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
