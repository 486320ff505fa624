"""``lightning_zero.initialize``: DeepSpeed's engine API on :class:`ZeroEngine`, without Lightning.

    engine, optimizer, loader, scheduler = lightning_zero.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json", training_data=dataset)
    for batch in loader:
        loss = engine(batch)                 # forward (autocast in 16-bit modes)
        engine.backward(loss)                # / accumulation steps, fp16 loss scaling, no_sync before the boundary
        engine.step()                        # at the boundary: unscale, overflow vote, clip, step, scheduler
    engine.save_checkpoint("ckpt", tag="step100")   # the strategy's sharded format: either side loads it

Launched by ``torchrun`` (or as one process); NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from . import ds_glue, process_group
from .checkpoint import sharded
from .collectives import Comm
from .config import ZeroConfig
from .ds_config import DeepSpeedImport, import_deepspeed_config
from .engine import ZeroEngine
from .precision.step import LossScaling, make_scaler, zero_step

__all__ = ["initialize", "ZeroModelEngine"]

_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, None: torch.float32}


def _setup_distributed() -> tuple[torch.device, int]:
    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo")
        process_group.exit_hook.arm()  # see [Note: destroy the group at exit]
    return device, local


def initialize(model: nn.Module, model_parameters: Any = None, config: Union[str, Path, dict, ZeroConfig, None] = None,
               optimizer: Union[torch.optim.Optimizer, Callable[[Any], torch.optim.Optimizer], None] = None,
               lr_scheduler: Any = None, training_data: Any = None, collate_fn: Optional[Callable] = None,
               ) -> tuple[ZeroModelEngine, torch.optim.Optimizer, Any, Any]:
    """``(engine, optimizer, dataloader, lr_scheduler)`` as ``deepspeed.initialize`` returns them.

    ``config`` is a DeepSpeed JSON (path or dict) or a ZeroConfig; ``optimizer`` / ``lr_scheduler``
    may be objects or callables taking the parameters / the optimizer, and override the JSON's.
    """
    if isinstance(config, DeepSpeedImport):
        ds = config
    elif config is None or isinstance(config, ZeroConfig):
        ds = DeepSpeedImport(zero=config or ZeroConfig())
    else:
        ds = import_deepspeed_config(config)
    device, local = _setup_distributed()
    params = [p for p in (model_parameters if model_parameters is not None else model.parameters()) if p.requires_grad]
    model.to(device)
    optimizer, lr_scheduler = ds_glue.optimizer_and_scheduler(ds, params, optimizer, lr_scheduler)
    engine = ZeroModelEngine(model, optimizer, ds, device, local, lr_scheduler)
    loader = engine.dataloader(training_data, collate_fn) if training_data is not None else None
    return engine, optimizer, loader, lr_scheduler


class ZeroModelEngine:
    """The object ``initialize`` returns: forward, ``backward``, ``step``, checkpoints."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ds: DeepSpeedImport, device: torch.device,
                 local_rank: int, lr_scheduler: Any = None) -> None:
        self.module, self.optimizer, self.ds, self.lr_scheduler = model, optimizer, ds, lr_scheduler
        self.device, self.local_rank = device, local_rank
        self.comm = Comm.from_group(None) if dist.is_initialized() else Comm()
        self.compute_dtype = _DTYPES[ds.precision]
        # DeepSpeed's step clears the gradients: they go at the step (see [Note: when gradients are freed])
        self.zero = ZeroEngine(model, [optimizer], ds.zero, self.comm, device, self.compute_dtype, free_grads_at_step=True)
        self.scaling = LossScaling(make_scaler(ds.zero, self.compute_dtype))
        self.micro_steps = 0
        self.global_steps = 0

    # ---- DeepSpeed's attributes ----------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        return self.scaling.skipped

    @property
    def scaler(self) -> Any:
        return self.scaling.scaler

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def gradient_accumulation_steps(self) -> int:
        return self.ds.accumulate or 1

    def train_micro_batch_size_per_gpu(self) -> int:
        if self.ds.micro_batch_per_gpu:
            return self.ds.micro_batch_per_gpu
        if self.ds.train_batch_size:
            return self.ds.train_batch_size // (self.gradient_accumulation_steps() * self.world_size)
        return 1

    def train_batch_size(self) -> int:
        return self.ds.train_batch_size or self.train_micro_batch_size_per_gpu() * self.gradient_accumulation_steps() \
            * self.world_size

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def dataloader(self, data: Any, collate_fn: Optional[Callable] = None) -> torch.utils.data.DataLoader:
        # A DistributedSampler at every world size (as DeepSpeed): the same seeded order on 1 rank as on N
        sampler = torch.utils.data.DistributedSampler(data, self.world_size, self.global_rank)
        return _EpochLoader(data, batch_size=self.train_micro_batch_size_per_gpu(), sampler=sampler,
                            collate_fn=collate_fn, drop_last=True)

    # ---- training ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.module.training:
            self.zero.before_training_forward()
        context = (torch.autocast(self.device.type, dtype=self.compute_dtype)
                   if self.compute_dtype != torch.float32 else nullcontext())
        with context:
            return self.module(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        """DeepSpeed's semantics: the loss is divided by the accumulation steps; fp16 scales it."""
        loss = self.scaling.scale_loss(loss.float() / self.gradient_accumulation_steps(), self.zero)
        sync = self.is_gradient_accumulation_boundary()
        with nullcontext() if sync else self.zero.no_sync():
            self.zero.backward(loss)

    def step(self) -> None:
        """At the accumulation boundary: unscale and vote on overflow (fp16), clip, step or skip, scheduler."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        clip = self.ds.gradient_clip_val
        stepped, _ = zero_step(self.zero, self.optimizer, self.scaling,
                               (lambda: self.zero.clip_grad_norm_(self.optimizer, clip)) if clip else (lambda: None))
        if stepped and self.lr_scheduler is not None:  # as DeepSpeed: a skipped step does not advance the schedule
            self.lr_scheduler.step()
        self.optimizer.zero_grad()
        self.global_steps += 1

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The module's ``state_dict()`` with fp32 master values on the CPU, gathered unit by unit (empty on other
        ranks with ``rank0_only``): what ``save_pretrained`` / ``torch.save`` want."""
        from .engine.state import full_model_state

        return full_model_state(self.zero, keep=self.global_rank == 0 or not rank0_only)

    # ---- checkpoints (the strategy's sharded directory format) -----------------------------------
    def save_checkpoint(self, save_dir: Union[str, Path], tag: Optional[str] = None,
                        client_state: Optional[dict] = None) -> Path:
        path = Path(save_dir) / (tag or f"global_step{self.global_steps}")
        checkpoint = {"state_dict": sharded.model_shards(self.zero),
                      "optimizer_states": [sharded.optimizer_shards(self.zero, self.optimizer)],
                      "lr_schedulers": [self.lr_scheduler.state_dict()] if self.lr_scheduler is not None else [],
                      "global_step": self.global_steps, "micro_steps": self.micro_steps,
                      "loss_scaler": self.scaling.state_dict().get("loss_scaler"),
                      "client_state": client_state or {}}
        sharded.save(checkpoint, path, self.comm, sharded.describe_model(self.zero))
        if self.global_rank == 0:
            (Path(save_dir) / "latest").write_text(path.name)
        return path

    def load_checkpoint(self, load_dir: Union[str, Path], tag: Optional[str] = None,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True) -> tuple[Path, dict]:
        """Load a directory written by ``save_checkpoint`` or by ``Trainer.save_checkpoint`` (any world size)."""
        load_dir = Path(load_dir)
        if tag is None and (load_dir / "latest").is_file():
            tag = (load_dir / "latest").read_text().strip()
        path = load_dir / tag if tag else load_dir
        checkpoint = sharded.read(path)
        sharded.load_into_engine(checkpoint["state_dict"], self.zero)
        if load_optimizer_states and checkpoint.get("optimizer_states"):
            sharded.load_optimizer(checkpoint["optimizer_states"][0], self.zero, self.optimizer)
        if load_lr_scheduler_states and self.lr_scheduler is not None and checkpoint.get("lr_schedulers"):
            self.lr_scheduler.load_state_dict(checkpoint["lr_schedulers"][0])
        self.scaling.load_state_dict({"loss_scaler": checkpoint.get("loss_scaler")})
        self.global_steps = int(checkpoint.get("global_step", 0))
        self.micro_steps = int(checkpoint.get("micro_steps", self.global_steps * self.gradient_accumulation_steps()))
        return path, checkpoint.get("client_state", {})


class _EpochLoader(torch.utils.data.DataLoader):
    """Each pass over the loader is a new epoch of its DistributedSampler (a new seeded order,
    the same on every rank), so a plain ``for epoch ...: for batch in loader`` reshuffles."""

    epoch = 0

    def __iter__(self) -> Any:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return super().__iter__()
