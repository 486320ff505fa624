"""Save / resume cases for ``tests/test_checkpoint.py``; each rank returns what it saw.

[Note: why the batch is a function of the global step]
A ZeRO checkpoint must resume on a different number of ranks. With a DistributedSampler
the global batch of a step depends on the world size (and Lightning restarts a non-stateful
loader from its beginning when it resumes mid-epoch), so "resume on M ranks" and "train on N
ranks without interruption" would see different data. :class:`StepLM` instead builds its
batch from ``global_step`` alone and every rank uses the same one (the distributed sampler is
off). The averaged gradient is then that batch's gradient whatever the world size (averaging
identical values over 1, 2 or 4 ranks is exact), so one uninterrupted run is the reference for
every resume, and the tests also check that premise: uninterrupted runs on 1, 2 and 4 ranks agree.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
from dist_utils import full_state
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning_cases import TinyLM
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import ZeroConfig, ZeroPrecision, ZeroStrategy
from lightning_zero.checkpoint.export import write_checkpoint

VOCAB = 37


class StepLM(TinyLM):
    """TinyLM (tied weights, frozen layer, two param groups) with a per-step scheduler and step-derived data."""

    def __init__(self) -> None:
        super().__init__()
        self.seen_scales: list[float] = []  # loss scale at each training step (fp16 runs)
        self.seen_steps: list[int] = []
        self.fused: bool | None = None  # True: torch's fused AdamW (its step counters live on the device)

    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(1000 + self.global_step)
        idx = torch.randint(0, VOCAB, (8, 9), generator=g).to(self.device)
        self.seen_steps.append(self.global_step)
        self.seen_scales.append(self.trainer.precision_plugin.loss_scale
                                if hasattr(self.trainer.precision_plugin, "loss_scale") else 1.0)
        return super().training_step((idx,), batch_idx)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        rest = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=self.lr, betas=(0.9, 0.95), fused=self.fused)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dummy_loader() -> DataLoader:
    # Contents unused (StepLM makes its own batch); 16 batches per epoch, so all runs stay in epoch 0.
    return DataLoader(TensorDataset(torch.zeros(64, 9, dtype=torch.long)), batch_size=4)


def make_strategy(name: str, **options):
    backend = options.pop("process_group_backend", None)
    if name.startswith("ddp"):
        return DDPStrategy(process_group_backend=backend) if backend else name
    return ZeroStrategy(config=ZeroConfig(stage=int(name[-1]), reduce_bucket_size=options.pop("bucket", 500),
                                          **options), process_group_backend=backend)


class _StateAtEnd(Callback):
    """At on_train_end on every rank (the strategy is still set up): record the full state, maybe save."""

    def __init__(self, save_to: str | None = None) -> None:
        self.save_to = save_to

    def on_train_end(self, trainer, pl_module):
        self.state = {k: v.detach().float().cpu().clone()
                      for k, v in full_state(trainer).items()}
        if self.save_to is not None:
            trainer.save_checkpoint(self.save_to)  # on every rank: gathers the shards; rank 0 writes


def fit_steps(world: int, strategy: str, steps: int, ckpt_in: str | None = None, save_to: str | None = None,
              plugin: str = "", options: dict | None = None, inject: tuple = (), callbacks: list | None = None,
              ckpt_dir: str | None = None, save_after_fit: str | None = None, accelerator: str = "cpu",
              fused: bool | None = None, nodes: int = 1) -> dict:
    """Train StepLM to ``max_steps=steps`` (resuming from ``ckpt_in``).

    ``save_to`` saves from on_train_end; ``save_after_fit`` calls ``trainer.save_checkpoint`` once
    ``trainer.fit`` has returned (what users write after training). ``nodes``: the ranks as that many
    nodes (``nodes=world`` with dist_utils' ``one_gpu``: every rank on the one GPU).
    """
    assert lightning_zero  # registers the names
    pl.seed_everything(0, verbose=False)
    module = StepLM()
    module.inject_inf_at = set(inject)
    module.fused = fused
    end = _StateAtEnd(save_to)
    options = dict(options or {})
    if accelerator == "gpu" and nodes > 1:  # every rank on the one GPU: NCCL refuses that, gloo carries CUDA tensors
        options["process_group_backend"] = "gloo"
    trainer = pl.Trainer(accelerator=accelerator, devices=world // nodes, num_nodes=nodes, strategy=make_strategy(strategy, **options),
                         precision=None if plugin else "32-true", plugins=[ZeroPrecision(plugin)] if plugin else None,
                         max_steps=steps, logger=False, enable_checkpointing=bool(callbacks),
                         callbacks=[end, *(callbacks or [])], enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                         default_root_dir=ckpt_dir)
    trainer.fit(module, dummy_loader(), ckpt_path=ckpt_in)
    if save_after_fit is not None:
        trainer.save_checkpoint(save_after_fit)
    sched = trainer.lr_scheduler_configs[0].scheduler
    out = {"state": end.state, "global_step": trainer.global_step, "sched": sched.state_dict(),
           "lrs": [g["lr"] for g in trainer.optimizers[0].param_groups], "losses": list(module.losses),
           "seen_steps": list(module.seen_steps), "seen_scales": list(module.seen_scales),
           "final": final_state(trainer, module, strategy)}
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    out["scaler"] = dict(scaler.state_dict()) if scaler is not None else None
    return out


def final_state(trainer, module, strategy: str) -> dict:
    """What the user gets after fit: stages 1/2 and DDP hand the module back with its trained values;
    stage 3 keeps it sharded, and the strategy streams the full state dict to rank 0 (``{}`` elsewhere)."""
    if strategy == "zero3":
        return {k: v.float().clone() for k, v in trainer.strategy.full_state_dict().items()}
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def guarded(fn, *args, **kwargs) -> dict:
    """Run a case and return its exception (type and message) instead of raising it."""
    try:
        return {"ok": fn(*args, **kwargs)}
    except Exception as err:  # noqa: BLE001 - the test inspects the error
        return {"error": type(err).__name__, "message": str(err), "types": [c.__name__ for c in type(err).__mro__]}


def drop_key(src: str, dst: str, key: str) -> None:
    ckpt = torch.load(src, weights_only=False)
    del ckpt["state_dict"][key]
    torch.save(ckpt, dst)


def modelcheckpoint_case(world: int, dirpath: str, first: int, total: int) -> dict:
    """ModelCheckpoint(save_last=True, every 2 steps) to ``first`` steps, then resume ckpt_path="last"."""
    cb = ModelCheckpoint(dirpath=dirpath, save_last=True, every_n_train_steps=2, save_top_k=-1)
    first_run = fit_steps(world, "zero2", first, callbacks=[cb], ckpt_dir=dirpath)
    files = sorted(os.listdir(dirpath))
    saved_step = torch.load(os.path.join(dirpath, "last.ckpt", "meta.pt"), weights_only=False)["global_step"]
    cb2 = ModelCheckpoint(dirpath=dirpath, save_last=True, every_n_train_steps=2, save_top_k=-1)
    resumed = fit_steps(world, "zero2", total, ckpt_in="last", callbacks=[cb2], ckpt_dir=dirpath)
    return {"first": first_run, "files": files, "resumed": resumed, "last_global_step": saved_step}


FIRST, TOTAL = 5, 9  # save after FIRST steps, resume to TOTAL


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


FULL = dict(options=dict(checkpoint_format="full"))


def world2_cases(rank: int, world: int, d: str) -> dict:
    """Everything that runs on two ranks, in one spawn (failing cases last).

    Sharded directories (the default format) unless the name says ``full``."""
    out = {"a": fit_steps(world, "zero2", FIRST, save_to=f"{d}/a.ckpt"),
           "ref": fit_steps(world, "zero2", TOTAL),
           "resumed": fit_steps(world, "zero2", TOTAL, ckpt_in=f"{d}/a.ckpt"),
           "zero1_resumed": fit_steps(world, "zero1", TOTAL, ckpt_in=f"{d}/a.ckpt"),
           "last": modelcheckpoint_case(world, f"{d}/mc", 4, TOTAL),
           # the same world-size and stage independent pieces: across stages both ways
           "z3_a": fit_steps(world, "zero3", FIRST, save_to=f"{d}/z3.ckpt"),
           "z3_resumed": fit_steps(world, "zero3", TOTAL, ckpt_in=f"{d}/z3.ckpt"),
           "z3_from_z2": fit_steps(world, "zero3", TOTAL, ckpt_in=f"{d}/a.ckpt"),
           "z2_from_z3": fit_steps(world, "zero2", TOTAL, ckpt_in=f"{d}/z3.ckpt"),
           "z1_a": fit_steps(world, "zero1", FIRST, save_to=f"{d}/z1.ckpt")}
    out["z3_from_z1"] = fit_steps(world, "zero3", TOTAL, ckpt_in=f"{d}/z1.ckpt")
    fp16 = dict(plugin="16-mixed", options=dict(initial_scale_power=8, hysteresis=1), inject=(1,))
    out["fp16_a"] = fit_steps(world, "zero2", 4, save_to=f"{d}/fp16.ckpt", **fp16)
    out["fp16_ref"] = fit_steps(world, "zero2", 7, **fp16)
    out["fp16_resumed"] = fit_steps(world, "zero2", 7, ckpt_in=f"{d}/fp16.ckpt", **fp16)
    # one-file checkpoints (checkpoint_format="full") keep working, into every stage
    out["full_a"] = fit_steps(world, "zero2", FIRST, save_to=f"{d}/full.ckpt", **FULL)
    out["full_resumed"] = fit_steps(world, "zero2", TOTAL, ckpt_in=f"{d}/full.ckpt")
    out["z3_from_full"] = fit_steps(world, "zero3", TOTAL, ckpt_in=f"{d}/full.ckpt")
    if rank == 0:
        drop_key(f"{d}/full.ckpt", f"{d}/missing.ckpt", "fc1.bias")
        write_checkpoint(f"{d}/a.ckpt", f"{d}/consolidated.ckpt")
    _barrier()
    out["missing_key"] = guarded(fit_steps, world, "zero2", TOTAL, ckpt_in=f"{d}/missing.ckpt")
    out["ddp_written"] = fit_steps(world, "ddp", FIRST, save_to=f"{d}/ddp.ckpt")
    out["ddp_to_zero"] = guarded(fit_steps, world, "zero2", TOTAL, ckpt_in=f"{d}/ddp.ckpt")
    out["zero_to_ddp"] = guarded(fit_steps, world, "ddp", TOTAL, ckpt_in=f"{d}/full.ckpt")
    out["consolidated_to_ddp"] = guarded(fit_steps, world, "ddp", TOTAL, ckpt_in=f"{d}/consolidated.ckpt")
    return out


def world4_cases(rank: int, world: int, d: str) -> dict:
    return {"ref": fit_steps(world, "zero2", TOTAL),
            "resumed": fit_steps(world, "zero2", TOTAL, ckpt_in=f"{d}/a.ckpt"),
            "a4": fit_steps(world, "zero2", FIRST, save_to=f"{d}/a4.ckpt"),
            "z3_from2": fit_steps(world, "zero3", TOTAL, ckpt_in=f"{d}/z3.ckpt")}
