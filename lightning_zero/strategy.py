"""ZeroStrategy: the thin Lightning adapter around :class:`lightning_zero.engine.ZeroEngine`.

Lightning owns the loop; this class only answers its lifecycle hooks: start the process
group, build the engine once the optimizers exist, skip gradient reduction inside
``block_backward_sync`` (stage 1), route the step through :class:`ZeroPrecision`, and
save/restore full, world-size independent state. What it reads of Lightning goes through
public API, :mod:`lightning_zero.lightning_loop` and :mod:`lightning_zero.lightning_compat`.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import Tensor

from . import ds_glue, lightning_compat, lightning_loop, process_group
from .auto_placement import AutoPlacement
from .checkpoint import lightning_io
from .collectives import Comm
from .config import ZeroConfig, ZeroConfigError, _reject_unknown
from .engine import ZeroEngine
from .engine.materialize import RngState, has_meta, meta_parameters, move_all_but_flattened
from .engine.memory import MemoryReport, memory_report
from .engine.schedule_check import GatherScheduleError
from .engine.state import full_model_state, full_optimizer_state
from .errors import user_errors
from .lightning_grad_norm import install as install_grad_norm
from .precision.buffers import match_compute_dtype
from .precision.plugin import ZeroPrecision, to_zero_precision
from .presets import PRESETS
from .summary import install_summary

__all__ = ["ZeroStrategy"]

log = logging.getLogger(__name__)

class ZeroStrategy(ParallelStrategy):
    """ZeRO stages 1-3 for any LightningModule.

    Args:
        config: the ZeRO settings: a ZeroConfig, a strategy name (``ZeroStrategy("zero3")``) or a dict of
            ZeroConfig fields; fields may also be given as keyword arguments (``ZeroStrategy(stage=3, prefetch=2)``),
            which override the config's.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            as for Lightning's DDPStrategy (the Trainer fills them in).
        process_group_backend: "nccl" on GPUs and "gloo" on CPU by default.
        deepspeed_config: a DeepSpeed JSON (path or dict) whose settings fill the config.
        **options: ZeroConfig fields.
    """

    strategy_name = "zero"

    def __init__(self, config: Union[ZeroConfig, str, dict, None] = None, accelerator: Any = None,
                 parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None,
                 checkpoint_io: Optional[CheckpointIO] = None, precision_plugin: Optional[Precision] = None,
                 process_group_backend: Optional[str] = None, deepspeed_config: Any = None, **options: Any) -> None:
        _reject_unknown(options)
        self.config, self.deepspeed = ds_glue.resolve(config, deepspeed_config, options, rank_zero_warn)
        inert = self.config.inert_settings()
        if inert:
            rank_zero_warn("lightning_zero: " + "; ".join(inert) + ": ignored.")
        self._zero_precision: Optional[ZeroPrecision] = None
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._nodes = 1
        self._process_group_backend = process_group_backend
        self.engine: Optional[ZeroEngine] = None
        self.comm = Comm()
        self._init_rng: Optional[RngState] = None
        self._parked: Optional[ZeroEngine] = None  # stages 1/2: the last fit's shards, for saving after fit returns
        self._final_report: Optional[MemoryReport] = None
        self._failed = False  # an exception ended this rank's run (see teardown)
        self._host_recheck = False  # offload: check the host budget again before the first step
        self._undo_hold: Optional[Callable[[], None]] = None  # scheduler_on_skip="hold" (see setup)
        self._undo_averaging: Optional[Callable[[], None]] = None  # stage 3: averaging callbacks gather (setup)
        self._norm_hooks: list[Any] = []  # BatchNorm under 16-bit compute (precision/batchnorm.py)
        self._auto = AutoPlacement(self)  # zero_auto's plan, measured first step and re-plan
        self._predict_repeats: Optional[lightning_loop.RepeatLastBatch] = None  # stage 3, uneven predict batches
        self._dumping = False  # inside the trainer's building of a checkpoint dict (see lightning_module_state_dict)
        self._engine_steps = False  # the engine was built for a fit: it steps the strategy's optimizers

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
        return self._nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def optimizers(self) -> list[Any]:
        return ParallelStrategy.optimizers.fget(self)

    @optimizers.setter
    def optimizers(self, optimizers: list[Any]) -> None:
        ParallelStrategy.optimizers.fset(self, optimizers)  # Lightning builds new wrappers here
        if getattr(self, "engine", None) is not None and self._engine_steps:
            if self.engine.adopt_optimizers(optimizers):  # a callback may set new ones during fit
                self._auto.overlap_after_first = None  # zero_auto's later overlap named the old optimizer
            self.engine.route_wrappers(lightning_compat.lightning_optimizers(self))

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # As under DDP, a checkpoint's weights and callback states load into the plain module before
        # setup (so a module's on_load_checkpoint runs before configure_optimizers) and the engine
        # shards those values. A model still on the meta device can only take them after setup.
        # A stage-3 engine kept after fit holds the only copy of the weights (the module's parameters are
        # placeholders): a checkpoint loaded then (test(ckpt_path=...)) goes into its shards; so does one given to a
        # new Trainer with a module an earlier Trainer's stage-3 engine still shards (its setup unshards it first).
        module = self.lightning_module
        return module is not None and (has_meta(module) or self.engine is not None or process_group.is_kept(module))

    @property
    def precision_plugin(self) -> ZeroPrecision:
        plugin = getattr(self, "_zero_precision", None)
        return plugin if plugin is not None else ZeroPrecision("32-true", self.config)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        if plugin is not None:
            given = str(getattr(plugin, "precision", "32-true"))
            wanted = ds_glue.precision_for(getattr(self, "deepspeed", None), given, isinstance(plugin, ZeroPrecision))
            if wanted is not None:  # the Trainer kept its default: the JSON decides
                plugin = ZeroPrecision(wanted, self.config)
            plugin = to_zero_precision(plugin, self.config)
        self._zero_precision = plugin
        ParallelStrategy.precision_plugin.fset(self, plugin)

    def connect(self, model: Any) -> None:
        super().connect(model)
        if self.deepspeed is not None:
            ds_glue.install_optimizers(self.deepspeed, model, rank_zero_warn)

    def on_train_start(self) -> None:
        super().on_train_start()
        if self.deepspeed is not None and self.lightning_module is not None:
            ds_glue.check_loader_batch(self.deepspeed, self.lightning_module.trainer, self.world_size)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        lightning_compat.set_launcher(self, _SubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                                      self.num_nodes))

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = (self._process_group_backend
                                       or lightning_compat.default_backend_for(self.root_device))
        self.comm.close_control()  # a strategy used for a second run: its earlier check group goes
        self.comm = process_group.start_lightning_group(self.cluster_environment, self._process_group_backend,
                                                        self.config.collective_timeout_s, self.root_device)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    # ---- setup ---------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self._failed = False
        lightning_compat.mark_checkpoint_dumps(trainer, self._mark_dumping)
        lightning_compat.tell_throughput_monitors(trainer, self.root_device, self.precision_plugin.compute_dtype)
        if self.deepspeed is not None:
            ds_glue.apply_to_trainer(self.deepspeed, trainer, self.world_size)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.engine is None or fitting or self.engine.module is not self.lightning_module:
            self._release_engine()
            if fitting and self._layer_sync is not None:  # Trainer(sync_batchnorm=True), as DDPStrategy's setup
                self._sync_batchnorm()
            self.model_to_device()
            if fitting:
                self.setup_optimizers(trainer)
            if self.config.auto_placement:
                self._auto.plan(trainer)
            self._build_engine(trainer, fitting)
        else:  # evaluation after fit (stage 3): the kept engine's shards are the model
            self.model_to_device()
            self.engine.restore_param_views()
            if self.config.broadcast_buffers:  # as DDP's setup for evaluation: every rank evaluates with rank 0's
                self.engine.broadcast_buffers()
        self.setup_precision_plugin()
        if fitting and self.precision_plugin.scaler is not None and self.config.scheduler_on_skip == "hold":
            self._undo_hold = lightning_loop.hold_schedulers_on_skip(trainer, self.lightning_module,
                                                                     self.precision_plugin.step_applied)

    def _sync_batchnorm(self) -> None:
        if self.root_device.type == "cpu":
            raise ZeroConfigError("Trainer(sync_batchnorm=True) converts BatchNorm layers to torch's SyncBatchNorm, "
                                  "which runs on GPUs only: train on GPUs, or drop sync_batchnorm on CPU.")
        self.model = self._layer_sync.apply(self.model)

    def _place_host_threads(self) -> None:
        """Offload: each rank's host step takes its share of the node's cores (OMP_NUM_THREADS wins)."""
        import os

        from .host_memory import host_threads

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = host_threads(cores, self.num_processes, torch.get_num_threads(), "OMP_NUM_THREADS" in os.environ)
        if threads is not None:
            torch.set_num_threads(threads)
            rank_zero_info(f"lightning_zero: the host step uses {threads} threads per rank ({cores} cores, "
                           f"{self.num_processes} ranks on the node; OMP_NUM_THREADS overrides)")

    def _check_host_memory(self, trainer: Any) -> None:
        """Offload: the host memory the plan needs must be there (MemAvailable, the cgroup limit, the node's other
        ranks) before anything is allocated: one error on every rank instead of the kernel's OOM kill."""
        from .host_memory import read_host_budget, shortfall
        from .planner import host_bytes_per_rank, placement_name

        numel = sum(p.numel() for p in self.lightning_module.parameters())
        needed = host_bytes_per_rank(numel, self.config, self.world_size,
                                     4 if self.precision_plugin.compute_dtype == torch.float32 else 2,
                                     int(trainer.accumulate_grad_batches or 1))
        budget = read_host_budget(self.num_processes, returning=self._module_bytes_on_host())
        self._refuse_on_every_rank(shortfall(needed, budget, f"ZeroStrategy ({placement_name(self.config)})"))

    def _refuse_on_every_rank(self, problem: Optional[str]) -> None:
        """Any rank's host-memory problem stops every rank (one rank raising alone would leave the others hanging)."""
        from .host_memory import HostMemoryError

        problem = next((p for p in self.comm.all_gather_object(problem) if p), None)
        if problem:
            raise HostMemoryError(problem)

    def _recheck_host_memory(self) -> None:
        """Before the first step: the optimizer state it will create on the host must still fit (dataloader
        workers and other processes start after setup); one error on every rank instead of an OOM kill."""
        from .host_memory import first_step_shortfall, read_host_budget

        offloader = self.engine.offloader if self.engine is not None else None
        if offloader is not None and offloader.speculating:  # its copy first: when short, the step waits instead
            blocker = self.engine.speculation_blocker(list(self.optimizers), self.num_processes)
            if blocker:
                rank_zero_info(self.engine.overlap_step(None, blocker))
        pending = offloader.pending_host_bytes(self.optimizers) if offloader is not None else 0
        self._refuse_on_every_rank(first_step_shortfall(pending, read_host_budget(self.num_processes)) if pending
                                   else None)

    def _build_engine(self, trainer: Any, fitting: bool) -> None:
        optimizers = list(self.optimizers) if fitting else []
        self._engine_steps = fitting
        if self.config.offloads and fitting:
            self._check_host_memory(trainer)
        self._host_recheck = bool(self.config.offloads and fitting)
        self.engine = engine = ZeroEngine(
            self.lightning_module, optimizers, self.config, self.comm, self.root_device,
            self.precision_plugin.compute_dtype, init_rng=self._init_rng,
            wrappers=lightning_compat.lightning_optimizers(self) if fitting else (),
            free_grads_at_step=fitting and lightning_loop.zero_grad_before_next_backward(self.lightning_module))
        self.precision_plugin.attach(engine, self.root_device.type)
        self._norm_hooks = match_compute_dtype(self.lightning_module, self.precision_plugin.compute_dtype,
                                           getattr(self.precision_plugin, "mixed", False))
        engine.say, engine.ranks_on_node = rank_zero_info, self.num_processes
        if self.config.delayed_step and engine.offloader is not None and fitting and not engine.free_grads_at_step:
            raise ZeroConfigError(
                "ZeroConfig.delayed_step=True needs the gradients cleared at every step (automatic optimization with "
                "Lightning's own optimizer_zero_grad): the next window's gradients would otherwise add into the ones "
                "the delayed update is still reading. Use the stock optimizer_zero_grad or set delayed_step=False.")
        install_grad_norm()  # Lightning's grad_norm(module, 2) reads the engine's gradients from here on
        readers = lightning_loop.gradient_readers(trainer, self.lightning_module) if fitting else []
        if readers:
            rank_zero_warn(f"lightning_zero: {', '.join(readers)} run with each parameter's .grad None: the gradients "
                           f"live in the engine's shards. Lightning's grad_norm(module, 2) reads them (on every rank), "
                           f"lightning_zero.utils.safe_get_full_grad(p) reads one (on every rank), clip with "
                           f"self.clip_gradients(optimizer, ...) or torch.nn.utils.clip_grad_norm_ on every rank.")
        if fitting and self._sharded_checkpoints and not lightning_io.module_state_is_local(engine, True):
            hooks = lightning_loop.checkpoint_readers(trainer, self.lightning_module, users_only=True)
            if hooks:
                rank_zero_warn(f"lightning_zero: {', '.join(hooks)} see(s) each parameter in checkpoint['state_dict'] "
                               f"as a DTensor sharded over the ranks (Shard(0)): a norm or sum of it read with float() "
                               f"or .item() is this rank's part only. Read whole values with .full_tensor() on every "
                               f"rank, or use checkpoint_format='full'.")
        if engine.offloader is not None:  # the host may step during backward only when nothing comes between
            blocker = (lightning_loop.overlap_blocker(trainer, self.lightning_module, optimizers)
                       if fitting else "not fitting")
            speculate = lightning_loop.gradient_changers(trainer, self.precision_plugin.scaler is not None)
            if blocker is None and speculate:
                blocker = engine.speculation_blocker(optimizers, self.num_processes)
            if blocker is None and fitting and self._auto.active:
                # zero_auto may still re-plan in its first step (replan.py): the masters must keep their initial
                # values until then, so the host steps after backward once and overlaps from the second step on
                self._auto.overlap_after_first = (optimizers[0], speculate)
                blocker = "zero_auto's first step, which may still plan again; overlapped from the second step"
            rank_zero_info(engine.overlap_step(optimizers[0] if blocker is None else None, blocker, speculate))
            self._place_host_threads()
        if self.config.shard_params:
            install_summary(trainer)
        if fitting and engine.gatherer is not None and len(engine.gatherer.persistent) < len(engine.units):
            self._gather_for_averaging(trainer)

    def _gather_for_averaging(self, trainer: Any) -> None:
        """Stage 3 with sharded units: Lightning's weight-averaging callbacks see whole parameters (averaging.py)."""
        from .averaging import gather_for_averaging

        names, undo = gather_for_averaging(trainer, self.lightning_module)
        if names:
            self._undo_averaging = undo
            from .engine.memory import fmt_bytes

            size = fmt_bytes(sum(p.numel() for p in self.lightning_module.parameters()) * 4)
            rank_zero_info(f"lightning_zero stage 3: {', '.join(names)} read every parameter between steps: their hooks "
                           f"gather the whole model in fp32 ({size}) on every rank while they run")

    def model_to_device(self) -> None:
        """Everything but the floating-point parameters, which the engine takes to the device unit by unit
        (``move_all_but_flattened``: a 2.7B model under a 24 GiB cap ran out of memory when zero_auto's move put
        the whole fp32 module on the GPU beside the new masters). A meta module is materialized by the engine."""
        assert self.model is not None
        if not has_meta(self.model):
            move_all_but_flattened(self.model, self.root_device)
        lightning_compat.record_module_device(self.model, self.root_device)

    def _module_bytes_on_host(self) -> int:
        """Host bytes of the module's floating-point parameters that the engine takes to the device as it builds
        its units (freed there, before the offloaded state is allocated): they count as host memory the placement
        may use. 0 on a CPU device (the engine's copies stay in host memory)."""
        if self.root_device.type == "cpu":
            return 0
        return sum(p.numel() * p.element_size() for p in self.lightning_module.parameters()
                   if p.is_floating_point() and p.device.type == "cpu")

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Stage 3 builds models with their parameters on the meta device (buffers for real, see
        ``meta_parameters``); the engine materializes them shard by shard."""
        if not self.config.shard_params or empty_init is False:
            with super().tensor_init_context(empty_init):
                yield
            return
        real_bytes = 0 if empty_init else self.config.real_init_bytes
        with meta_parameters(self.root_device, real_bytes) as build, self.precision_plugin.tensor_init_context():
            yield
        self._init_rng = build.rng

    # ---- the training step (Lightning calls these after setup: the engine exists) -----------------
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches: stage 1 accumulates full gradients locally (stage 2+ must reduce)."""
        with self.engine.no_sync():
            yield

    def pre_backward(self, closure_loss: Tensor) -> None:
        self.engine.begin_backward(closure_loss)

    def post_backward(self, closure_loss: Tensor) -> None:
        self.engine.end_backward()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._host_recheck:
            self._host_recheck = False
            self._recheck_host_memory()
        return self._auto.training_step(self._training_step, *args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        try:
            return self._auto.backward(super().backward, closure_loss, optimizer, *args, **kwargs)
        except RuntimeError as err:  # a stage-3 placeholder captured outside its forward shows in backward's shapes
            if self.engine is not None:
                self.engine.explain_placeholder_use(err, only_sharded=False)
            raise

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.engine.before_training_forward()
        # stage 3: the root's parameters stay gathered until the backward that follows ends (the loss may use them)
        with self.engine.hold(self.lightning_module, until_backward_end=torch.is_grad_enabled()):
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:  # DDP's forward runs it: buffers as DDP's
            self.engine.before_eval_forward()
        with self.engine.hold(self.lightning_module, until_backward_end=False):
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.engine.hold(self.lightning_module, until_backward_end=False):
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.engine.hold(self.lightning_module, until_backward_end=False):
            out = super().predict_step(*args, **kwargs)
        if self._predict_repeats is not None:
            self._predict_repeats.after_step(self._repeat_predict_step, args, kwargs)
        return out

    def _repeat_predict_step(self, *args: Any, **kwargs: Any) -> None:
        """A predict step whose output is dropped: this rank joins the gathers of the others' extra batches."""
        with self.engine.hold(self.lightning_module, until_backward_end=False):
            super().predict_step(*args, **kwargs)

    def step_applied(self, optimizer: Any) -> Optional[bool]:
        """Whether ``optimizer``'s last step changed the model: False when fp16 overflow skipped it, None before
        its first step. Manual optimization steps its schedulers itself: ``if strategy.step_applied(opt): sch.step()``
        keeps DeepSpeed's rule (automatic optimization does it for you, see ``ZeroConfig.scheduler_on_skip``)."""
        return self.precision_plugin.step_applied(optimizer)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        model = model if model is not None else self.lightning_module
        return self.precision_plugin.zero_optimizer_step(optimizer, model=model, closure=closure, **kwargs)

    # ---- evaluation: every rank must run the same forward passes under stage 3 ------------------
    def on_validation_start(self) -> None:
        self._settle()
        trainer = self.lightning_module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._check_even(trainer.fit_loop.epoch_loop.val_loop if fitting else trainer.validate_loop, "val")

    def on_test_start(self) -> None:
        self._settle()
        self._check_even(self.lightning_module.trainer.test_loop, "test")

    def on_predict_start(self) -> None:
        self._settle()
        self._predict_repeats = None
        uneven = self._uneven(self.lightning_module.trainer.predict_loop)
        if uneven is not None:  # Lightning's predict sampler does not pad: short ranks repeat their last batch
            mine, low, high = uneven
            if min(mine) == 0:
                raise lightning_loop.uneven_batches_error("predict", mine, low, high)
            self._predict_repeats = lightning_loop.RepeatLastBatch(mine, high)

    def on_train_end(self) -> None:
        self._check_gather_schedule()
        super().on_train_end()

    def on_validation_end(self) -> None:
        self._check_gather_schedule()
        super().on_validation_end()

    def on_test_end(self) -> None:
        self._check_gather_schedule()
        super().on_test_end()

    def on_predict_end(self) -> None:
        self._check_gather_schedule()
        super().on_predict_end()

    def _check_gather_schedule(self) -> None:
        """Stage 3: the last steps of a loop gathered alike on every rank (see engine/schedule_check.py)."""
        if self.engine is not None and not self._failed:
            self.engine.check_gather_schedule(wait=True)

    def _settle(self) -> None:
        """delayed_step: evaluation sees the latest update (every rank is here: the publish is a collective)."""
        if self.engine is not None:
            self.engine.settle()

    def _check_even(self, loop: Any, stage: str) -> None:
        uneven = self._uneven(loop)
        if uneven is not None:
            raise lightning_loop.uneven_batches_error(stage, *uneven)

    def _uneven(self, loop: Any) -> Optional[tuple[list[int], list[int], list[int]]]:
        """Stage 3 with sharded units: every forward gathers, so an extra batch on one rank would hang."""
        gatherer = self.engine.gatherer if self.engine is not None else None
        if gatherer is None or len(gatherer.persistent) == len(gatherer.units):
            return None  # nothing gathers in a forward: any counts run
        return lightning_loop.uneven_batches(loop, self.comm, self.root_device)

    # ---- collectives Lightning uses (metrics, logging, barriers) -------------------------------
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.comm.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.comm.broadcast_object(obj, src)

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        comm = self.comm if group is None else Comm.from_group(group)
        return comm.reduce_value(tensor, reduce_op or "mean")

    # ---- state -------------------------------------------------------------------------------------
    @property
    def _state_engine(self) -> Optional[ZeroEngine]:
        """The engine whose shards hold the weights: the live one, or the last fit's (stages 1/2)."""
        engine = self.engine or self._parked
        if engine is None or not engine.units:
            return None
        engine.settle(publish=False)  # delayed_step: the fp32 state is whole once the running update is done
        return engine

    @property
    def _sharded_checkpoints(self) -> bool:
        return self.config.checkpoint_format == "sharded" and self._state_engine is not None

    def _rendezvous(self, what: str) -> None:
        """Entry check of a collective user code calls: a rank that never comes is an error, not a hang (named as the
        user called it: inside a checkpoint's building that is trainer.save_checkpoint or ModelCheckpoint)."""
        if self._dumping:
            what = "trainer.save_checkpoint() (ModelCheckpoint calls it too)"
        self.comm.rendezvous(what, self.config.rendezvous_timeout_s)

    def memory_report(self) -> MemoryReport:
        """Per-rank model-state bytes (measured) beside the ZeRO formulas (after fit: its last state)."""
        if self.engine is None:
            if self._final_report is None:
                raise RuntimeError("memory_report() needs a set-up strategy: call it during or after trainer.fit().")
            return self._final_report
        return memory_report(self.engine)

    def grad_norm(self, norm_type: Union[float, int, str] = 2.0, group_separator: str = "/") -> dict[str, Tensor]:
        """Lightning's ``grad_norm(module, norm_type)`` for a module whose gradients live in the engine's shards
        (each parameter's ``.grad`` is None in ``on_before_optimizer_step``): the same keys and values, each
        parameter's norm over every rank. A collective: call it on every rank, e.g. in
        ``on_before_optimizer_step``: ``self.log_dict(self.trainer.strategy.grad_norm(2))``."""
        norm_type = float(norm_type)
        if norm_type <= 0:
            raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
        if self.engine is None:
            raise RuntimeError("grad_norm() reads the gradients of a fit in progress: call it from a training hook.")
        self._rendezvous("trainer.strategy.grad_norm()")
        norms = {f"grad_{norm_type}_norm{group_separator}{name}": value
                 for name, value in self.engine.grad_norms(norm_type).items()}
        if norms:
            norms[f"grad_{norm_type}_norm_total"] = torch.stack(list(norms.values())).norm(norm_type)
        return norms

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
        group order, per-parameter tensors whole, on the CPU). A collective, like :meth:`full_state_dict`."""
        engine = self._state_engine
        if engine is None:
            return optimizer.state_dict()
        self._rendezvous("trainer.strategy.full_optimizer_state_dict()")
        return full_optimizer_state(engine, optimizer, keep=self.is_global_zero or not rank0_only)

    def _mark_dumping(self, on: bool) -> None:
        self._dumping = on

    def _pieces_suffice(self) -> bool:
        """[Note: DTensors only where someone looks]
        Inside ``trainer.save_checkpoint`` no user code sees the checkpoint dict unless a module or callback
        overrides ``on_save_checkpoint``. Without one the DTensors would only be written, and building them
        copies each rank's share of the state (ZeRO's pieces are not DTensor's row chunks, see
        checkpoint/boxes.py): each rank's pieces are written in place instead, the same files without the copy."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return self._dumping and trainer is not None and not lightning_loop.checkpoint_readers(trainer,
                                                                                               self.lightning_module)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state for a checkpoint.

        Sharded format (the default): the module's keys; each managed parameter is a ``DTensor`` (``Shard(0)``
        on a 1-D mesh over the strategy's ranks, the parameter's shape, fp32 master values), as FSDP2's
        ``get_model_state_dict`` gives them: ``.full_tensor()``, ``.to_local()``, elementwise math and
        ``torch.distributed.checkpoint`` work as torch documents. Tied parameters are one object under each
        name. Buffers and parameters lightning_zero does not manage are plain tensors. On one rank, and under
        stages 1/2 computing in fp32 (there ``Replicate``: a norm read on one rank is the parameter's own), the
        DTensors are views of the live values and building them runs no collective (a callback may call it on
        one rank); otherwise every rank must call it (ZeRO's pieces are
        not DTensor's row chunks: they are exchanged) and the DTensors are a host copy of this rank's share.

        ``checkpoint_format="full"``: the full fp32 state dict (stages 1/2 on every rank, stage 3 on rank 0
        only, so that a model too big for one rank is not copied into every rank's memory).
        """
        engine = self._state_engine
        if engine is None:
            return super().lightning_module_state_dict()
        in_place = self._sharded_checkpoints and self._pieces_suffice()
        if not (in_place or lightning_io.module_state_is_local(engine, self._sharded_checkpoints)):
            self._rendezvous("trainer.strategy.lightning_module_state_dict()")
        keep = self.is_global_zero or not self.config.shard_params
        return lightning_io.module_state(engine, self._sharded_checkpoints, keep, in_place)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """An optimizer's state for a checkpoint (a collective). Sharded format: torch's optimizer state keyed
        by parameter name, per-element state (exp_avg, ...) as DTensors shaped like the parameter, as FSDP2's
        ``get_optimizer_state_dict`` gives it; full format: consolidated on rank 0."""
        engine = self._state_engine
        if engine is None:
            return super().optimizer_state(optimizer)
        self._rendezvous("trainer.strategy.optimizer_state()")
        in_place = self._sharded_checkpoints and self._pieces_suffice()
        return lightning_io.optimizer_state(engine, optimizer, self._sharded_checkpoints, self.is_global_zero, in_place)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self._rendezvous("trainer.save_checkpoint()")
        lightning_io.save(checkpoint, filepath, self._state_engine, self.comm, self._sharded_checkpoints,
                          storage_options, super().save_checkpoint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return lightning_io.load(checkpoint_path, self.engine, self.lightning_module,
                                 type(self.checkpoint_io) is TorchCheckpointIO,
                                 lambda: super(ZeroStrategy, self).load_checkpoint(checkpoint_path, weights_only),
                                 weights_only, self.comm)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        lightning_io.load_model(checkpoint, self.engine, self.lightning_module, strict,
                                lambda: super(ZeroStrategy, self).load_model_state_dict(checkpoint, strict))

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.engine is not None
        lightning_loop.replay_finetuning_restore(self.lightning_module.trainer, self.lightning_module)
        lightning_io.load_optimizers(self.engine, self.optimizers, checkpoint["optimizer_states"])

    # ---- teardown ---------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        # Collectives of ours may still be in flight (the exception interrupted a backward): at exit
        # destroying the group would wait for them, i.e. for peers that will never join them.
        process_group.exit_hook.clean = False
        self._failed = True  # teardown must not wait in a collective the other ranks may never join
        self._name_collective_failure(exception)
        super().on_exception(exception)

    def _name_collective_failure(self, exception: BaseException) -> None:
        """See [Note: a failure named on every rank] in :mod:`lightning_zero.collectives`: the rank whose engine named
        the cause leaves it; a rank that failed in some other collective's wait adds it to its own error."""
        if isinstance(exception, GatherScheduleError):
            self.comm.report_failure(str(exception))
        elif isinstance(exception, RuntimeError) and not isinstance(exception, user_errors()) \
                and _collective_failure(exception):  # ours (a missing rank at a rendezvous) name their cause
            # the rank that names the cause times out later: its gathers in flight each time out in turn first
            cause = self.comm.reported_failure(min(8 * self.config.collective_timeout_s + 10.0, 240.0))
            if cause is not None:
                exception.args = (f"{cause}\n(this rank's own wait: {exception.args[0] if exception.args else ''})",
                                  *exception.args[1:])

    def teardown(self) -> None:
        """No rank gathers the model here. Stage 3 keeps its engine (the module stays sharded, and
        validate/test/predict after fit run sharded); stages 1/2 give the module back with its
        trained parameters in place and keep only their shards (for saving after fit). After an
        error on this rank nothing is kept and no collective runs."""
        for undo in (self._undo_hold, self._undo_averaging):
            if undo is not None:
                undo()
        self._undo_hold = self._undo_averaging = None
        engine = self.engine
        if engine is not None and not self._failed:
            engine.settle()  # delayed_step: the last update reaches the module
        if engine is not None and engine.units:
            self._final_report = memory_report(engine)
        if engine is not None and self._failed:
            engine.detach(wait=False)
            engine.close()
            self.engine = None
        elif engine is not None and not self.config.shard_params:
            engine.park()
            self._parked, self.engine = engine, None
        elif engine is not None:
            if getattr(self.precision_plugin, "mixed", False):
                engine.compute_in_fp32()  # user code after fit sees fp32 parameters, as under DDP
            process_group.keep_engine(engine)  # a later Trainer given this module unshards it first
        super().teardown()  # moves the module (and the optimizer state) to the CPU, as under DDP
        if self._parked is not None:
            self._parked.drop_full()

    def _release_engine(self) -> None:
        """Before a new engine: hand the module back as plain parameters holding the trained values.

        The module may still be sharded by the stage-3 engine of an earlier Trainer (its fit kept the
        module sharded): that engine gives the values back first."""
        self._parked, self._auto.overlap_after_first = None, None
        for handle in self._norm_hooks:
            handle.remove()
        self._norm_hooks = []
        kept = process_group.take_kept_engine(self.lightning_module)
        for engine in {id(e): e for e in (self.engine, kept) if e is not None}.values():
            engine.unflatten(torch.device("cpu"))  # one unit at a time on the device; model_to_device follows
            engine.close()
            engine.free()  # Lightning still holds the old loss and optimizer while zero_auto builds the next engine
        released = self.engine is not None or kept is not None
        self.engine = None
        if self._zero_precision is not None:
            self._zero_precision.attach(None, self.root_device.type)
        if released:  # what is left (arenas, threads) sits in reference cycles: free it before a new engine is
            gc.collect()  # built beside it (a 2.7B model under a 24 GiB cap ran out of memory there)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, description, config in PRESETS:
            strategy_registry.register(name, cls, description=description, config=config)


def _collective_failure(exception: BaseException) -> bool:
    """A collective that failed in its wait (a timeout, a peer gone), by the backends' messages."""
    text = str(exception)
    return any(mark in text for mark in ("Timed out", "timed out", "Connection closed by peer", "NCCL", "gloo"))
