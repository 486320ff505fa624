"""fp16 steps skipped for overflow and the LR schedule, in both front ends (tests/test_skip_schedule.py).

An overflow is forced at chosen steps by an infinite loss on one rank only (every rank must skip)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import ZeroPrecision

STEPS = 8
OVERFLOW_AT = (2, 5)  # optimizer steps (from 0) whose loss is infinite on rank 1


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 1, generator=g))


class Regression(pl.LightningModule):
    def __init__(self, interval: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.interval = interval
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        loss = (self.net(x).float() - y).pow(2).mean()
        if batch_idx in OVERFLOW_AT and self.global_rank == 1:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval}}


def lightning_case(rank: int, world: int, stage: int, on_skip: str, interval: str) -> dict:
    assert lightning_zero
    module = Regression(interval)
    data = DataLoader(_data(), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=world,
                         strategy=lightning_zero.ZeroStrategy(stage=stage, scheduler_on_skip=on_skip, initial_scale_power=4),
                         plugins=[ZeroPrecision("16-mixed")], max_steps=STEPS, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    sched = trainer.lr_scheduler_configs[0].scheduler
    return {"lrs": module.lrs, "last_epoch": sched.last_epoch, "global_step": trainer.global_step,
            "applied": trainer.strategy.step_applied(trainer.optimizers[0]),
            "hooked": "lr_scheduler_step" in module.__dict__}


def engine_case(rank: int, world: int, stage: int, on_skip: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True, "initial_scale_power": 8},
              "zero_optimization": {"stage": stage},
              **({"lightning_zero": {"scheduler_on_skip": on_skip}} if on_skip != "default" else {}),
              "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0,
                                                           "warmup_num_steps": 20, "warmup_type": "linear"}}}
    engine, _, loader, sched = lightning_zero.initialize(model=model, model_parameters=model.parameters(),
                                                         config=config, training_data=_data())
    lrs, applied = [], []
    for i, (x, y) in enumerate(loader):
        if i == STEPS:
            break
        lrs.append(engine.get_lr()[0])
        loss = (engine(x).float() - y).pow(2).mean()
        if i in OVERFLOW_AT and rank == 1:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        applied.append(engine.was_step_applied())
    return {"lrs": lrs, "applied": applied, "skipped": engine.skipped_steps, "global_steps": engine.global_steps,
            "iteration": sched.last_batch_iteration}
