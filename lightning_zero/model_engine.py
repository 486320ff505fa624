"""``ZeroModelEngine``: what ``lightning_zero.initialize`` returns, the counterpart of DeepSpeed's engine.

Like ``DeepSpeedEngine`` it is an ``nn.Module`` around the model (``engine.module``), so a DeepSpeed
script's ``model.train()`` / ``model.eval()`` / ``model.parameters()`` work unchanged, and it keeps
DeepSpeed's names and semantics: ``backward`` divides the loss by the accumulation steps and
scales it for fp16; ``step`` acts only at the accumulation boundary (overflow vote, clipping,
step or skip, scheduler; a skipped step does not advance the scheduler); ``global_steps`` counts
boundaries, skipped ones included, ``skipped_steps`` the skipped ones.

[Note: checkpoints of the engine API]
``save_checkpoint(dir, tag)`` writes ``dir/tag`` in the strategy's sharded format (any world size
and stage reads it; ``Trainer.fit(ckpt_path=...)`` too) and ``dir/latest`` naming the tag, as
DeepSpeed. ``load_checkpoint`` reads those and also DeepSpeed's own directories (written by
DeepSpeed or Lightning's ``DeepSpeedStrategy``; see :mod:`.checkpoint.deepspeed_format`).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from .checkpoint import deepspeed_format, sharded
from .checkpoint.files import META_FILE
from .collectives import Comm
from .ds_config import DeepSpeedImport, resolve_batch
from .engine import ZeroEngine
from .engine.materialize import RngState
from .engine.state import full_model_state, load_model_state, load_optimizer_state
from .precision.buffers import match_compute_dtype
from .precision.step import LossScaling, make_scaler, zero_step

log = logging.getLogger(__name__)

__all__ = ["ZeroModelEngine"]

_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, None: torch.float32}
_CONVERTER = '''"""Written by lightning_zero beside its checkpoints, as DeepSpeed writes its own:
    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT [--tag TAG]
"""
from lightning_zero.utils.zero_to_fp32 import main

if __name__ == "__main__":
    main()
'''


class ZeroModelEngine(nn.Module):
    """The model under ZeRO with DeepSpeed's engine API: forward, ``backward``, ``step``, checkpoints."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ds: DeepSpeedImport, device: torch.device,
                 local_rank: int, comm: Comm, lr_scheduler: Any = None, init_rng: Optional[RngState] = None) -> None:
        super().__init__()
        self.module = model
        self.optimizer, self.ds, self.lr_scheduler = optimizer, ds, lr_scheduler
        self.device, self.local_rank, self.comm = device, local_rank, comm
        self.compute_dtype = _DTYPES[ds.precision]
        # DeepSpeed's step clears the gradients: they go at the step (see [Note: when gradients are freed])
        self.zero = ZeroEngine(model, [optimizer], ds.zero, comm, device, self.compute_dtype, init_rng=init_rng,
                               free_grads_at_step=True)
        self.scaling = LossScaling(make_scaler(ds.zero, self.compute_dtype))
        match_compute_dtype(model, self.compute_dtype, mixed=True)  # its forward runs under autocast (see forward)
        self.zero.ranks_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if self.zero.offloader is not None:  # the host steps during backward; clipping / fp16 make it speculative
            changers = " and ".join(what for what, present in (("gradient clipping", bool(ds.gradient_clip_val)),
                                                               ("fp16 loss scaling", self.scaling.scaler is not None))
                                    if present) or None
            blocker = (self.zero.speculation_blocker([optimizer], int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
                       if changers and ds.zero.speculative_step is not False else None)
            log.info(self.zero.overlap_step(None if blocker else optimizer, blocker, changers))
        # DeepSpeed derives the missing one of batch / micro-batch / accumulation and refuses a mismatch
        tbs, mbs, gas = resolve_batch(ds.train_batch_size, ds.micro_batch_per_gpu, ds.accumulate, comm.world_size)
        self._batch, self._micro_batch, self._accumulate = tbs, mbs or 1, gas or 1
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self._boundary: Optional[bool] = None  # set_gradient_accumulation_boundary
        self._grad_norm: Optional[float] = None
        self._step_applied = False
        self.training_dataloader: Optional[torch.utils.data.DataLoader] = None  # initialize(training_data=...)'s

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

    dp_world_size = world_size  # data parallelism only: the same number

    mp_world_size = 1

    def fp16_enabled(self) -> bool:
        return self.compute_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.compute_dtype == torch.bfloat16

    def zero_optimization(self) -> bool:
        return True

    def zero_optimization_stage(self) -> int:
        return self.ds.zero.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.ds.zero.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.ds.zero.stage == 3

    def zero_offload_optimizer(self) -> bool:
        return self.ds.zero.offload_optimizer != "none"

    def zero_offload_param(self) -> bool:
        return self.ds.zero.offload_params != "none"

    def gradient_clipping(self) -> float:
        return self.ds.gradient_clip_val or 0.0

    def gradient_accumulation_steps(self) -> int:
        return self._accumulate

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch

    def train_batch_size(self) -> int:
        return self._batch or self._micro_batch * self._accumulate * self.world_size

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary rule for the next ``backward``/``step`` (DeepSpeed's manual mode)."""
        self._boundary = is_boundary

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        """Each param group's ``betas`` (Adam family) or ``momentum`` (SGD), as DeepSpeed reports them."""
        return [group["betas"] if "betas" in group else group.get("momentum") for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        """The gradient norm over every rank at the last step, before clipping (None before the first)."""
        return self._grad_norm

    def get_loss_scale(self) -> float:
        return self.scaling.scale

    def was_step_applied(self) -> bool:
        """False when the last boundary's step was skipped for fp16 overflow."""
        return self._step_applied

    def dataloader(self, data: Any, collate_fn: Optional[Callable] = None, batch_size: Optional[int] = None
                   ) -> torch.utils.data.DataLoader:
        # A DistributedSampler at every world size (as DeepSpeed): the same seeded order on 1 rank as on N
        sampler = torch.utils.data.DistributedSampler(data, self.world_size, self.global_rank)
        return _EpochLoader(data, batch_size=batch_size or self.train_micro_batch_size_per_gpu(), sampler=sampler,
                            collate_fn=collate_fn, drop_last=True)

    def deepspeed_io(self, dataset: Any, batch_size: Optional[int] = None, collate_fn: Optional[Callable] = None,
                     **_: Any) -> torch.utils.data.DataLoader:
        return self.dataloader(dataset, collate_fn, batch_size)

    # ---- training ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # DDP's buffer rule needs to know at the forward whether this micro-batch ends its window (Lightning's
        # loop runs the forward inside no_sync; here only backward is), and evaluation forwards follow it too
        if self.module.training:
            with nullcontext() if self.is_gradient_accumulation_boundary() else self.zero.no_sync():
                self.zero.before_training_forward()
        else:
            self.zero.before_eval_forward()
        context = (torch.autocast(self.device.type, dtype=self.compute_dtype)
                   if self.compute_dtype != torch.float32 else nullcontext())
        with context, self.zero.forward_scope():
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """DeepSpeed's semantics: the loss is divided by the accumulation steps; fp16 scales it; no reduction
        before the boundary."""
        scaled = loss.float() / self.gradient_accumulation_steps() if scale_wrt_gas else loss.float()
        scaled = self.scaling.scale_loss(scaled, self.zero)
        with nullcontext() if self.is_gradient_accumulation_boundary() else self.zero.no_sync():
            self.zero.backward(scaled, retain_graph=retain_graph)
        return loss

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally, without communication (every stage here)."""
        with self.zero.no_sync():
            yield

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """At the accumulation boundary: unscale and vote on overflow (fp16), clip, step or skip, scheduler."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self._boundary = None
        if not boundary:
            return
        clip = self.ds.gradient_clip_val

        def before_step() -> None:
            norm = (self.zero.clip_grad_norm_(self.optimizer, clip) if clip
                    else self.zero.grad_norm(self.optimizer))
            self._grad_norm = float(norm)

        self._step_applied, _ = zero_step(self.zero, self.optimizer, self.scaling, before_step)
        advance = self._step_applied or self.ds.zero.scheduler_on_skip == "advance"
        if advance and self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.optimizer.zero_grad()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    # ---- state -----------------------------------------------------------------------------------
    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The module's ``state_dict()`` with fp32 master values on the CPU, gathered unit by unit (empty on other
        ranks with ``rank0_only``): what ``save_pretrained`` / ``torch.save`` want. Every rank must call it."""
        self.comm.rendezvous("ZeroModelEngine.full_state_dict()", self.ds.zero.rendezvous_timeout_s)
        return full_model_state(self.zero, keep=self.global_rank == 0 or not rank0_only)

    def save_16bit_model(self, save_dir: Union[str, Path], save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the module's state dict in the compute dtype (fp32 when training in fp32), gathered from
        the shards; every rank must call it."""
        state = self.full_state_dict()
        if self.global_rank == 0:
            frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            out = {k: (v.to(self.compute_dtype) if v.is_floating_point() else v) for k, v in state.items()
                   if not (exclude_frozen_parameters and k in frozen)}
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            torch.save(out, Path(save_dir) / save_filename)
        self.comm.barrier()
        return True

    save_fp16_model = save_16bit_model  # DeepSpeed's older name

    def save_checkpoint(self, save_dir: Union[str, Path], tag: Optional[str] = None,
                        client_state: Optional[dict] = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Every rank writes its part of ``save_dir/tag`` (see [Note: checkpoints of the engine API])."""
        self.comm.rendezvous("ZeroModelEngine.save_checkpoint()", self.ds.zero.rendezvous_timeout_s)
        within = self.micro_steps % self.gradient_accumulation_steps()
        if within and self.global_rank == 0:  # as DeepSpeed: the window's gradients are not state; say so
            warnings.warn(f"save_checkpoint after {within} of {self.gradient_accumulation_steps()} micro-batches of an "
                          f"accumulation window: the gradients summed so far are not saved, and a resume starts the "
                          f"window again. Save after engine.step() at a boundary (is_gradient_accumulation_boundary()).",
                          stacklevel=2)
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        path = Path(save_dir) / tag
        checkpoint = {"state_dict": sharded.model_pieces(self.zero),
                      "optimizer_states": [sharded.optimizer_pieces(self.zero, self.optimizer)],
                      "lr_schedulers": [self.lr_scheduler.state_dict()] if self.lr_scheduler is not None else [],
                      "global_step": self.global_steps, "micro_steps": self.micro_steps,
                      "global_samples": self.global_samples, "skipped_steps": self.skipped_steps,
                      "loss_scaler": self.scaling.state_dict().get("loss_scaler"),
                      "client_state": dict(client_state or {})}
        sharded.save(checkpoint, path, self.comm, sharded.describe_model(self.zero))
        if self.global_rank == 0:
            if save_latest:
                (Path(save_dir) / "latest").write_text(tag)
            (Path(save_dir) / "zero_to_fp32.py").write_text(_CONVERTER)
        self.comm.barrier()
        return True

    def load_checkpoint(self, load_dir: Union[str, Path], tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None
                        ) -> tuple[Optional[str], Optional[dict]]:
        """``(path, client_state)`` from a directory ours or DeepSpeed wrote (any world size and stage).

        As DeepSpeed: without ``tag`` the ``latest`` file names it, and when there is none this warns and returns
        ``(None, None)`` (a script's first start); a named tag that is not there is an error.
        """
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint(custom_load_fn=...) is not supported by lightning_zero: load the "
                             "weights with lightning_zero.utils.zero_to_fp32 and apply your function to them.")
        load_dir = Path(load_dir)
        if tag is None:
            latest = load_dir / "latest"
            if load_dir.is_file() or (not latest.is_file() and load_dir.is_dir() and (
                    (load_dir / META_FILE).is_file() or deepspeed_format.find_tag_dir(load_dir) == load_dir)):
                # a script's first start has no checkpoint at all; this is one, named the wrong way: nothing would load
                raise FileNotFoundError(
                    f"load_checkpoint({str(load_dir)!r}): that is a checkpoint itself, not the directory of its tags. "
                    f"Call load_checkpoint({str(load_dir.parent)!r}, tag={load_dir.name!r}) (or the save_dir whose "
                    f"'latest' file names the tag).")
            if not latest.is_file():
                warnings.warn(f"Unable to find a 'latest' file in {load_dir}: no checkpoint loaded. Pass tag=... to "
                              f"load a particular checkpoint.", stacklevel=2)
                return None, None
            tag = latest.read_text().strip()
        path = load_dir / str(tag)
        if not path.is_dir():
            raise FileNotFoundError(f"Checkpoint {path} does not exist: tags in {load_dir} are "
                                    f"{sorted(p.name for p in load_dir.iterdir() if p.is_dir()) if load_dir.is_dir() else 'none (no such directory)'}.")
        self.comm.rendezvous("ZeroModelEngine.load_checkpoint()", self.ds.zero.rendezvous_timeout_s)
        if deepspeed_format.is_deepspeed_checkpoint(path):
            client = self._load_deepspeed(path, load_module_strict, load_optimizer_states and not load_module_only,
                                          load_lr_scheduler_states and not load_module_only)
        else:
            client = self._load_ours(path, load_module_strict, load_optimizer_states and not load_module_only,
                                     load_lr_scheduler_states and not load_module_only, load_module_only)
        return str(path), client

    def _load_ours(self, path: Path, strict: bool, optimizer: bool, scheduler: bool, module_only: bool) -> dict:
        checkpoint = sharded.read(path, self.comm)
        sharded.load_into_engine(checkpoint["state_dict"], self.zero, strict=strict)
        if optimizer and checkpoint.get("optimizer_states"):
            sharded.load_optimizer(checkpoint["optimizer_states"][0], self.zero, self.optimizer)
        if scheduler and self.lr_scheduler is not None and checkpoint.get("lr_schedulers"):
            self.lr_scheduler.load_state_dict(checkpoint["lr_schedulers"][0])
        if not module_only:
            self.scaling.load_state_dict({"loss_scaler": checkpoint.get("loss_scaler")})
            self._restore_counters(checkpoint.get("global_step", 0), checkpoint.get("micro_steps"),
                                   checkpoint.get("global_samples"), checkpoint.get("skipped_steps", 0))
        return checkpoint.get("client_state", {})

    def _load_deepspeed(self, path: Path, strict: bool, optimizer: bool, scheduler: bool) -> dict:
        ckpt = deepspeed_format.DeepSpeedCheckpoint(path)
        load_model_state(self.zero, ckpt.weights(keys=_state_keys(self.module)), strict=strict)
        if optimizer:
            load_optimizer_state(self.zero, self.optimizer, ckpt.optimizer_state(self.optimizer))
        if scheduler and self.lr_scheduler is not None and ckpt.lr_scheduler is not None:
            deepspeed_format.load_scheduler(self.lr_scheduler, ckpt.lr_scheduler)
        self._restore_counters(ckpt.global_steps, None, ckpt.global_samples, ckpt.skipped_steps)
        return ckpt.client_state

    def _restore_counters(self, global_steps: int, micro_steps: Optional[int], samples: Optional[int],
                          skipped: int) -> None:
        self.global_steps = int(global_steps or 0)
        self.micro_steps = int(micro_steps if micro_steps is not None
                               else self.global_steps * self.gradient_accumulation_steps())
        self.global_samples = int(samples if samples is not None else self.global_steps * self.train_batch_size())
        self.scaling.skipped = int(skipped or 0)


def _state_keys(module: nn.Module) -> set[str]:
    from .engine.guard import allow_state_dict

    with allow_state_dict():
        return set(module.state_dict(keep_vars=True).keys())


class _EpochLoader(torch.utils.data.DataLoader):
    """Each pass over the loader is a new epoch of its DistributedSampler (a new seeded order,
    the same on every rank), so a plain ``for epoch ...: for batch in loader`` reshuffles."""

    epoch = 0

    def __iter__(self) -> Any:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return super().__iter__()
