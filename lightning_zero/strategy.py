"""ZeroStrategy: the thin Lightning adapter around :class:`lightning_zero.engine.ZeroEngine`.

Lightning owns the loop; this class only answers its lifecycle hooks: start the process
group, build the engine once the optimizers exist, skip gradient reduction inside
``block_backward_sync`` (stage 1), route the step through :class:`ZeroPrecision`, and
save/restore full, world-size independent state.
"""

from __future__ import annotations

import atexit
import logging
import types
import weakref
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from .checkpoint import sharded
from .checkpoint.files import CheckpointPathError
from .collectives import Comm
from .config import ZeroConfig, _reject_unknown
from .ds_config import DeepSpeedConfigError, DeepSpeedImport, build_optimizer, check_batch, import_deepspeed_config
from .elastic import attempt_store
from .engine import ZeroEngine
from .engine.materialize import RngState, has_meta
from .engine.memory import MemoryReport, memory_report
from .engine.state import check_keys, full_model_state, full_optimizer_state, load_model_state, load_optimizer_state
from .lightning_compat import lightning_optimizers
from .precision.plugin import ZeroPrecision
from .summary import install_summary

__all__ = ["ZeroStrategy"]

log = logging.getLogger(__name__)


PRESETS = (
    ("zero2_offload", "ZeRO stage 2; fp32 master, gradients and optimizer state on the CPU, stepped there",
     ZeroConfig(stage=2, offload_optimizer="cpu")),
    ("zero3_offload", "ZeRO stage 3; optimizer side and parameter shards on the CPU",
     ZeroConfig(stage=3, offload_optimizer="cpu", offload_params="cpu")),
    ("zero3_offload_nvme", "ZeRO stage 3; optimizer state and parameter shards in files under nvme_path "
     "(or $LIGHTNING_ZERO_NVME_PATH)", ZeroConfig(stage=3, offload_optimizer="nvme", offload_params="nvme")),
    ("zero_auto", "ZeRO with the stage and offload placement planned at setup for the devices and model",
     ZeroConfig(auto_placement=True)),
)


class ZeroStrategy(ParallelStrategy):
    """ZeRO stages 1-3 for any LightningModule.

    Args:
        config: the ZeRO settings; fields may also be given as keyword arguments
            (``ZeroStrategy(stage=3, prefetch=2)``), which override the config's.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            as for Lightning's DDPStrategy (the Trainer fills them in).
        process_group_backend: "nccl" on GPUs and "gloo" on CPU by default.
        **options: ZeroConfig fields.
    """

    strategy_name = "zero"

    def __init__(self, config: Optional[ZeroConfig] = None, accelerator: Any = None,
                 parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None,
                 checkpoint_io: Optional[CheckpointIO] = None, precision_plugin: Optional[Precision] = None,
                 process_group_backend: Optional[str] = None, deepspeed_config: Any = None, **options: Any) -> None:
        _reject_unknown(options)
        self.config = (config or ZeroConfig()).replace(**options) if options else (config or ZeroConfig())
        self.deepspeed: Optional[DeepSpeedImport] = None
        if deepspeed_config is not None:  # the JSON fills what it says; explicit options still win
            self.deepspeed = import_deepspeed_config(deepspeed_config, base=config)
            self.config = self.deepspeed.zero.replace(**options) if options else self.deepspeed.zero
            if self.deepspeed.warnings:
                rank_zero_warn("lightning_zero read the DeepSpeed config: " + "; ".join(self.deepspeed.warnings) + ".")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self.engine: Optional[ZeroEngine] = None
        self.comm = Comm()
        self._init_rng: Optional[RngState] = None
        self._parked: Optional[ZeroEngine] = None  # stages 1/2: the last fit's shards, for saving after fit returns
        self._sync_buffers_next = True
        self._final_report: Optional[MemoryReport] = None
        self._failed = False  # an exception ended this rank's run (see teardown)

    # ---- what Lightning asks of a parallel strategy ---------------------------------------
    @property
    def is_distributed(self) -> bool:
        return True  # without it Lightning drops DistributedSampler and sync_dist for unknown strategies

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def optimizers(self) -> list[Any]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[Any]) -> None:
        ParallelStrategy.optimizers.fset(self, optimizers)  # Lightning builds new wrappers here
        if getattr(self, "engine", None) is not None:
            self.engine.route_wrappers(lightning_optimizers(self))

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # As under DDP, a checkpoint's weights and callback states load into the plain module before
        # setup (so a module's on_load_checkpoint runs before configure_optimizers) and the engine
        # shards those values. A model still on the meta device can only take them after setup.
        # A stage-3 engine kept after fit holds the only copy of the weights (the module's parameters are
        # placeholders): a checkpoint loaded then (test(ckpt_path=...)) goes into its shards.
        module = self.lightning_module
        return module is not None and (has_meta(module) or self.engine is not None)

    @property
    def precision_plugin(self) -> ZeroPrecision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else ZeroPrecision("32-true", self.config)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        wanted = self.deepspeed.precision if getattr(self, "deepspeed", None) is not None else None
        if wanted is not None and plugin is not None:
            given = str(getattr(plugin, "precision", "32-true"))
            if given not in ("32-true", "32", wanted) and not isinstance(plugin, ZeroPrecision):
                raise DeepSpeedConfigError(f"The DeepSpeed config asks for {wanted} but the Trainer has precision="
                                           f"{given!r}: drop precision= from the Trainer or change fp16/bf16 in the JSON.")
            if given in ("32-true", "32"):  # the Trainer's default: the JSON decides
                plugin = ZeroPrecision(wanted, self.config)
        self._precision_plugin = None if plugin is None else _to_zero_precision(plugin, self.config)

    def connect(self, model: Any) -> None:
        super().connect(model)
        if self.deepspeed is not None and self.deepspeed.optimizer is not None:
            from lightning.pytorch.utilities.model_helpers import is_overridden

            if is_overridden("configure_optimizers", model):
                rank_zero_warn("The DeepSpeed config's optimizer/scheduler are ignored: the LightningModule "
                               "configures its own in configure_optimizers.")
            else:
                model.configure_optimizers = types.MethodType(_deepspeed_optimizers(self.deepspeed), model)

    def _apply_deepspeed_trainer_settings(self, trainer: Any) -> None:
        """gradient_clipping and gradient_accumulation_steps of the JSON, unless the Trainer says otherwise."""
        ds = self.deepspeed
        if ds is None:
            return
        if ds.gradient_clip_val is not None:
            if trainer.gradient_clip_val not in (None, 0, ds.gradient_clip_val):
                raise DeepSpeedConfigError(f"gradient_clipping={ds.gradient_clip_val} in the DeepSpeed config but "
                                           f"Trainer(gradient_clip_val={trainer.gradient_clip_val}): keep one of them.")
            trainer.gradient_clip_val = ds.gradient_clip_val
        if ds.accumulate is not None and trainer.accumulate_grad_batches == 1:
            trainer.accumulate_grad_batches = ds.accumulate

    def on_train_start(self) -> None:
        super().on_train_start()
        if self.deepspeed is not None and self.lightning_module is not None:
            trainer = self.lightning_module.trainer
            loader = trainer.train_dataloader
            batch = getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None),
                                                                    "batch_size", None)
            check_batch(self.deepspeed, batch, self.world_size, trainer.accumulate_grad_batches)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": timedelta(seconds=self.config.collective_timeout_s)}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        created = not _distributed_is_initialized()
        store = attempt_store(kwargs["timeout"]) if created else None  # see [Note: one store per attempt]
        if store is not None:
            kwargs["store"] = store
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        if created:  # a group we started is also ours to end: see [Note: destroy the group at exit]
            _exit_hook.arm()
        _exit_hook.clean = True
        self.comm.close_control()  # a strategy used for a second run: its earlier check group goes
        self.comm = Comm.from_group(None).with_control()
        _exit_hook.controls = [c for c in _exit_hook.controls if c.control is not None] + [self.comm]

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ---- setup ---------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self._failed = False
        self._apply_deepspeed_trainer_settings(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.engine is None or fitting or self.engine.module is not self.lightning_module:
            self._release_engine()
            self.model_to_device()
            if fitting:
                self.setup_optimizers(trainer)
            if self.config.auto_placement:
                self._plan_placement()
            optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers] if fitting else []
            self.engine = ZeroEngine(self.lightning_module, optimizers, self.config, self.comm, self.root_device,
                                     self.precision_plugin.compute_dtype, init_rng=self._init_rng,
                                     wrappers=lightning_optimizers(self) if fitting else ())
            self.engine.free_grads_at_step = fitting and _zero_grad_before_next_backward(self.lightning_module)
            self.precision_plugin.attach(self.engine, self.root_device.type)
            if self.engine.offloader is not None:
                total = sum(u.layout.shard_numel for u in self.engine.units)
                blocker = _overlap_blocker(trainer, self) if fitting else "not fitting"
                self.engine.overlap_step(optimizers[0] if blocker is None else None)
                when = ("overlaps backward" if blocker is None and self.config.overlap_step
                        else f"after backward ({blocker or 'overlap_step=False'})")
                rank_zero_info(f"lightning_zero {self.engine.offloader.describe(total)}; host step {when}")
            if self.config.shard_params:
                install_summary(trainer)
        else:  # evaluation after fit (stage 3): the kept engine's shards are the model
            self.model_to_device()
            self.engine.restore_param_views()
        self.setup_precision_plugin()

    def _plan_placement(self) -> None:
        """zero_auto: the planner picks stage and offload for these devices and this model (rank 0 decides)."""
        from .planner import choose, hardware_here

        module = self.lightning_module
        numel = sum(p.numel() for p in module.parameters())
        trainer = getattr(module, "_trainer", None)
        choice = choose(numel, hardware_here(self.root_device, self.num_processes, self.num_nodes, self.config),
                        self.config, compute_bytes=2 if self.precision_plugin.compute_dtype != torch.float32 else 4,
                        accumulate=int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        chosen = [choice.config.to_dict(), choice.why]
        if self.comm.world_size > 1:
            torch.distributed.broadcast_object_list(chosen, src=0)
        self.config = ZeroConfig.from_dict(chosen[0])
        self.precision_plugin.configure(self.config, explicit=False)
        log.info("lightning_zero zero_auto: %s", chosen[1])
        rank_zero_only(print)(f"lightning_zero zero_auto: {chosen[1]}")

    def model_to_device(self) -> None:
        assert self.model is not None
        if not has_meta(self.model):  # a meta model is materialized (and sharded) by the engine
            self.model.to(self.root_device)

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Stage 3 builds models on the meta device; the engine materializes them shard by shard."""
        if not self.config.shard_params or empty_init is False:
            with super().tensor_init_context(empty_init):
                yield
            return
        self._init_rng = RngState()
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    # ---- the training step ---------------------------------------------------------------------
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches: stage 1 accumulates full gradients locally (stage 2+ must reduce)."""
        if self.engine is None:
            yield
            return
        with self.engine.no_sync():
            yield

    def pre_backward(self, closure_loss: Tensor) -> None:
        if self.engine is not None:
            self.engine.begin_backward(closure_loss)

    def post_backward(self, closure_loss: Tensor) -> None:
        if self.engine is not None:
            self.engine.end_backward()

    @contextmanager
    def _root_gathered(self) -> Generator[None, None, None]:
        gatherer = self.engine.gatherer if self.engine is not None else None
        if gatherer is None:
            yield
            return
        # training: held until the backward that follows ends (the loss may use root parameters)
        with gatherer.hold(self.lightning_module, until_backward_end=torch.is_grad_enabled()):
            yield

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        # DDP's rule: rank 0's buffers are broadcast before the forward that follows a forward
        # which synchronized gradients (so at the first micro-batch of each accumulation window).
        if engine is not None and self.config.broadcast_buffers and self._sync_buffers_next:
            engine.broadcast_buffers()
        self._sync_buffers_next = torch.is_grad_enabled() and (engine is None or engine.syncing)
        with self._root_gathered():
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._root_gathered():
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._root_gathered():
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._root_gathered():
            return super().predict_step(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        model = model if model is not None else self.lightning_module
        return self.precision_plugin.zero_optimizer_step(optimizer, model=model, closure=closure, **kwargs)

    # ---- evaluation: every rank must run the same forward passes under stage 3 ------------------
    def on_validation_start(self) -> None:
        trainer = self.lightning_module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._check_even_batches(trainer.fit_loop.epoch_loop.val_loop if fitting else trainer.validate_loop, "val")

    def on_test_start(self) -> None:
        self._check_even_batches(self.lightning_module.trainer.test_loop, "test")

    def on_predict_start(self) -> None:
        self._check_even_batches(self.lightning_module.trainer.predict_loop, "predict")

    def _check_even_batches(self, loop: Any, stage: str) -> None:
        """Stage 3 gathers parameters in every forward: a rank with an extra batch would wait forever."""
        if not self.config.shard_params or self.comm.world_size == 1:
            return
        counts = [float(n) for n in getattr(loop, "max_batches", [])]
        if not counts or any(c == float("inf") for c in counts):
            return  # unsized loaders: the collective timeout turns a mismatch into an error
        mine = torch.tensor(counts, dtype=torch.float64, device=self.root_device)
        high, low = mine.clone(), -mine.clone()
        self.comm.all_reduce(high, op="max")
        self.comm.all_reduce(low, op="max")
        if not torch.equal(high, -low):
            raise RuntimeError(
                f"ZeroStrategy(stage=3): ranks have different numbers of {stage} batches (this rank: "
                f"{[int(c) for c in counts]}, between {[int(-x) for x in low.tolist()]} and "
                f"{[int(x) for x in high.tolist()]} across ranks). Every stage-3 forward gathers parameters on all "
                f"ranks, so uneven batches would hang. Use Lightning's DistributedSampler (use_distributed_sampler="
                f"True, the default), make your sampler give every rank the same number of batches, or evaluate "
                f"with stage 1/2.")

    # ---- collectives Lightning uses (metrics, logging, barriers) -------------------------------
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ---- state -------------------------------------------------------------------------------------
    @property
    def _state_engine(self) -> Optional[ZeroEngine]:
        """The engine whose shards hold the weights: the live one, or the last fit's (stages 1/2)."""
        engine = self.engine or self._parked
        return engine if engine is not None and engine.units else None

    @property
    def _sharded_checkpoints(self) -> bool:
        return self.config.checkpoint_format == "sharded" and self._state_engine is not None

    def _rendezvous(self, what: str) -> None:
        """Entry check of a collective user code calls: a rank that never comes is an error, not a hang."""
        self.comm.rendezvous(what, self.config.rendezvous_timeout_s)

    def memory_report(self) -> MemoryReport:
        """Per-rank model-state bytes (measured) beside the ZeRO formulas (after fit: its last state)."""
        if self.engine is None:
            if self._final_report is None:
                raise RuntimeError("memory_report() needs a set-up strategy: call it during or after trainer.fit().")
            return self._final_report
        return memory_report(self.engine)

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, Tensor]:
        """The trained model's full state dict (fp32 master values, the module's keys) on the CPU.

        A collective: call it on every rank. Units are gathered one at a time, so no rank's device
        holds more than one unit beyond its shard; only rank 0 keeps the result (other ranks get
        ``{}``) unless ``rank0_only=False``. Before any fit: the module's own state dict.
        """
        engine = self._state_engine
        if engine is None:
            return {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()}
        self._rendezvous("trainer.strategy.full_state_dict()")
        return full_model_state(engine, keep=self.is_global_zero or not rank0_only)

    def full_optimizer_state_dict(self, optimizer: Any, rank0_only: bool = True) -> dict[str, Any]:
        """``optimizer.state_dict()`` as the unsharded optimizer would return it (parameters numbered in
        group order, per-parameter tensors whole, on the CPU). A collective, like :meth:`full_state_dict`:
        call it on every rank; only rank 0 keeps the result unless ``rank0_only=False``."""
        engine = self._state_engine
        if engine is None:
            return optimizer.state_dict()
        self._rendezvous("trainer.strategy.full_optimizer_state_dict()")
        return full_optimizer_state(engine, optimizer, keep=self.is_global_zero or not rank0_only)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state for a checkpoint.

        Sharded format (the default): the module's keys; buffers and parameters lightning_zero does not
        manage are plain tensors; each managed parameter is a 1-D ``ShardedTensor`` of its ``numel``
        elements whose local shard is this rank's piece of the fp32 master (a view: no copy and no
        collective, so calling it on one rank is safe). A ShardedTensor supports ``local_shards()``,
        ``torch.save`` and ``.cpu()``, not elementwise math (``.float()`` raises). For the weights as
        plain full tensors call :meth:`full_state_dict` on every rank.

        ``checkpoint_format="full"``: the full fp32 state dict (a collective; stages 1/2 on every rank,
        stage 3 on rank 0 only, so that a model too big for one rank is not copied into every rank's memory).
        """
        engine = self._state_engine
        if engine is None:
            return super().lightning_module_state_dict()
        if self._sharded_checkpoints:
            return sharded.model_shards(engine)
        self._rendezvous("trainer.strategy.lightning_module_state_dict()")
        return full_model_state(engine, keep=self.is_global_zero or not self.config.shard_params)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        engine = self._state_engine
        if engine is None:
            return super().optimizer_state(optimizer)
        self._rendezvous("trainer.strategy.optimizer_state()")
        if self._sharded_checkpoints:
            return sharded.optimizer_shards(engine, optimizer)
        # as Lightning does for sharded optimizers: consolidated on rank 0, the rank that saves
        return full_optimizer_state(engine, optimizer, keep=self.is_global_zero)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Sharded: every rank writes its part of directory ``filepath`` (atomically, see
        ``checkpoint.files``). Full: rank 0 writes one file."""
        self._rendezvous("trainer.save_checkpoint()")
        if self._sharded_checkpoints:
            if storage_options is not None:
                raise TypeError("ZeroStrategy's sharded checkpoints take no storage_options; use "
                                "checkpoint_format='full' to save through a CheckpointIO plugin.")
            sharded.save(checkpoint, filepath, self.comm, sharded.describe_model(self._state_engine))
            return
        if Path(filepath).is_dir():
            raise CheckpointPathError(f"Cannot write a one-file checkpoint to {filepath}: it is a directory (a sharded "
                                      f"checkpoint?). Choose another path, or keep checkpoint_format='sharded'.")
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A sharded directory (any world size and stage wrote it) or a one-file checkpoint (read with
        ``mmap``: no rank copies the whole file into memory)."""
        path = Path(checkpoint_path)
        if path.is_dir() or not path.exists():
            checkpoint = sharded.read(path)  # names the missing / incomplete / foreign directory
            if self.engine is None:  # before setup: straight into the module's own tensors
                checkpoint["state_dict"] = sharded.load_into_module(checkpoint["state_dict"], self.lightning_module)
        elif type(self.checkpoint_io) is not TorchCheckpointIO:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        else:
            torch.cuda.empty_cache()
            checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=bool(weights_only))
        checkpoint["_path"] = str(path)  # for error messages; Lightning ignores unknown keys
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        saved = checkpoint["state_dict"]
        if isinstance(saved, sharded.SavedState):
            if self.engine is None or not self.engine.units:
                raise RuntimeError("A sharded checkpoint's weights load into a set-up engine; this is a bug.")
            sharded.load_into_engine(saved, self.engine, strict=strict)
            return
        if self.engine is None or not self.engine.units:
            if strict:
                check_keys(self.lightning_module.state_dict().keys(), saved.keys(), checkpoint.get("_path"))
            return super().load_model_state_dict(checkpoint, strict)
        load_model_state(self.engine, saved, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.engine is not None
        self._replay_finetuning_restore()
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if isinstance(state, sharded.SavedState):
                sharded.load_optimizer(state, self.engine, optimizer)
            else:
                load_optimizer_state(self.engine, optimizer, state)

    def _replay_finetuning_restore(self) -> None:
        """Fine-tuning callbacks re-create the param groups they added in ``on_fit_start``. With a
        checkpoint restored after setup (as here) their state loads after that hook, so the
        groups must be re-created now, before the optimizer state that refers to them loads."""
        from lightning.pytorch.callbacks import BaseFinetuning

        trainer = self.lightning_module.trainer
        for callback in trainer.callbacks:
            if isinstance(callback, BaseFinetuning) and getattr(callback, "_restarting", False):
                callback.on_fit_start(trainer, self.lightning_module)

    # ---- teardown ---------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        # Collectives of ours may still be in flight (the exception interrupted a backward): at exit
        # destroying the group would wait for them, i.e. for peers that will never join them.
        _exit_hook.clean = False
        self._failed = True  # teardown must not wait in a collective the other ranks may never join
        super().on_exception(exception)

    def teardown(self) -> None:
        """No rank gathers the model here. Stage 3 keeps its engine (the module stays sharded, and
        validate/test/predict after fit run sharded); stages 1/2 give the module back with its
        trained parameters in place and keep only their shards (for saving after fit)."""
        engine = self.engine
        if engine is not None and engine.units:
            self._final_report = memory_report(engine)
        if engine is not None and self._failed:  # after an error on this rank: no collective, nothing kept
            engine.detach(wait=False)
            if engine.offloader is not None:
                engine.offloader.close()
            self.engine = None
        elif engine is not None and not self.config.shard_params:
            engine.park()
            self._parked, self.engine = engine, None
        elif engine is not None:
            _kept_engines[engine.module] = engine  # a later Trainer given this module unshards it first
        super().teardown()  # moves the module (and the optimizer state) to the CPU, as under DDP
        if self._parked is not None:
            self._parked.drop_full()

    def _release_engine(self) -> None:
        """Before a new engine: hand the module back as plain parameters holding the trained values.

        The module may still be sharded by the stage-3 engine of an earlier Trainer (its fit kept the
        module sharded): that engine gives the values back first."""
        self._parked = None
        module = self.lightning_module
        kept = _kept_engines.pop(module, None) if module is not None else None
        for engine in {id(e): e for e in (self.engine, kept) if e is not None}.values():
            engine.unflatten(torch.device("cpu"))  # one unit at a time on the device; model_to_device follows
            _end_gather_group(engine)
            if engine.offloader is not None:
                engine.offloader.close()  # NVMe files go with the engine
        self.engine = None


    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for stage, what in ((1, "optimizer state"), (2, "optimizer state and gradients"),
                            (3, "optimizer state, gradients and parameters")):
            strategy_registry.register(f"zero{stage}", cls, description=f"ZeRO stage {stage}: shards {what}",
                                       config=ZeroConfig(stage=stage))
        for name, description, config in PRESETS:
            strategy_registry.register(name, cls, description=description, config=config)


_GRAD_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def _overlap_blocker(trainer: Any, strategy: ZeroStrategy) -> Optional[str]:
    """Why the host step may not start during backward (None: it may): something between backward and
    the step could still change the gradients, or the step happens elsewhere."""
    import lightning.pytorch as pl

    module = strategy.lightning_module
    if len(strategy.optimizers) != 1:
        return "several optimizers"
    if not module.automatic_optimization:
        return "manual optimization"
    if trainer.gradient_clip_val:
        return "gradient clipping"
    if getattr(strategy.precision_plugin, "scaler", None) is not None:
        return "fp16 loss scaling"
    for name in (*_GRAD_HOOKS, "configure_gradient_clipping", "optimizer_step"):
        if getattr(type(module), name) is not getattr(pl.LightningModule, name):
            return f"the module overrides {name}"
    for callback in trainer.callbacks:
        for name in _GRAD_HOOKS:
            if getattr(type(callback), name) is not getattr(pl.Callback, name):
                return f"{type(callback).__name__}.{name}"
    return None


def _zero_grad_before_next_backward(module: Any) -> bool:
    """Lightning's automatic optimization with the stock ``optimizer_zero_grad`` clears the gradients
    before any next backward: the engine may free them at the step (see [Note: when gradients are freed])."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return bool(module.automatic_optimization) and not is_overridden("optimizer_zero_grad", module)


def _end_gather_group(engine: ZeroEngine) -> None:
    """Destroy the process group stage 3 gathered on (``Comm.sibling``: one per engine).

    Its gloo worker threads live as long as the group object does, so the released engine must
    not keep it: otherwise every fit/validate/test would leave a group behind, and the last
    one would be torn down only during interpreter finalization, where a worker that still
    frees a finished all-gather's tensors aborts the process (see [Note: destroy the group at
    exit]). Stage 3 engines kept after fit end theirs in the exit hook. Not a collective: every
    rank's gathers were waited before unflatten's all-gathers.
    """
    gatherer = engine.gatherer
    if gatherer is None or gatherer.comm.group is None or gatherer.comm.group is engine.comm.group:
        return
    group, gatherer.comm = gatherer.comm.group, engine.comm  # the released engine gathers no more
    if _distributed_is_initialized():
        torch.distributed.destroy_process_group(group)


class _ExitHook:
    """[Note: destroy the group at exit]
    gloo runs each collective on one of its worker threads, and that thread drops its reference
    to the finished work (and so to the tensors the work moved) only after ``wait()`` has already
    returned in Python. Our collectives move tensors created in Python, and freeing those takes
    the GIL. A job ends milliseconds after its last collective (teardown gathers the full
    parameters, then the script returns), so on a busy host a late gloo worker can ask for the
    GIL after interpreter finalization has begun: CPython then ends that thread with
    ``pthread_exit``, whose forced unwind through a ``noexcept`` C++ destructor calls
    ``std::terminate`` ("terminate called without an active exception", SIGABRT) in a job that
    had finished (core dump: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherWork`` ->
    ``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread``). Destroying the
    group in an atexit handler, while the interpreter is still whole, joins gloo's workers
    before finalization. Lightning registers the same handler, for NCCL groups only; a second
    call is a no-op. After an exception we leave the group alone: destroying it would wait for
    collectives still in flight, which peers may never join.
    """

    def __init__(self) -> None:
        self.armed = False
        self.clean = True
        self.controls: list[Comm] = []  # strategies' rendezvous groups: closed (and dropped) here too

    def arm(self) -> None:
        if not self.armed:
            self.armed = True
            atexit.register(self._run)

    def _run(self) -> None:
        if self.clean:
            for engine in list(_kept_engines.values()):
                _end_gather_group(engine)
            for comm in self.controls:
                comm.close_control()
            _destroy_dist_connection()
        self.controls.clear()


_exit_hook = _ExitHook()
# module -> the stage-3 engine that still shards it after its fit (see ZeroStrategy._release_engine)
_kept_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _deepspeed_optimizers(ds: DeepSpeedImport) -> Callable:
    """``configure_optimizers`` for a module that has none: the JSON's optimizer and scheduler."""

    def configure_optimizers(module: Any) -> Any:
        optimizer = build_optimizer(ds.optimizer, [p for p in module.parameters() if p.requires_grad])
        if ds.scheduler is None:
            return optimizer
        from .ds_schedules import build_scheduler

        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": build_scheduler(optimizer, ds.scheduler), "interval": "step"}}

    return configure_optimizers


def _to_zero_precision(plugin: Precision, config: ZeroConfig) -> ZeroPrecision:
    """Turn Lightning's generic plugin (built from ``precision=``) into ours."""
    if isinstance(plugin, ZeroPrecision):
        if not plugin._config_explicit:
            plugin.configure(config, explicit=False)
        return plugin
    name = str(getattr(plugin, "precision", "32-true"))
    if type(plugin).__name__ not in ("Precision", "MixedPrecision", "HalfPrecision"):
        raise TypeError(f"ZeroStrategy cannot run with the precision plugin {type(plugin).__name__} "
                        f"(precision={name!r}); use precision='32-true', 'bf16-mixed', '16-mixed', 'bf16-true' or "
                        f"'16-true', or pass lightning_zero.ZeroPrecision(...) in plugins=[...].")
    return ZeroPrecision(name, config) if name.startswith("16") else ZeroPrecision(name)
