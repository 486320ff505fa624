"""A LightningModule with no configure_optimizers, trained from a DeepSpeed JSON (tests/test_deepspeed_config.py)."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import ZeroStrategy


class Regressor(pl.LightningModule):
    """Optimizer and scheduler come from the JSON."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.lrs: list[float] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.net(x).float() - y).pow(2).mean()
        self.losses.append(float(loss))
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])


def fit_from_json(rank: int, world: int, config, batch_size: int, steps: int = 6) -> dict:
    assert lightning_zero
    pl.seed_everything(0, verbose=False)
    module = Regressor()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 16, generator=g), torch.randn(512, 1, generator=g))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = ZeroStrategy(deepspeed_config=config)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(module, DataLoader(data, batch_size=batch_size))
    except Exception as err:  # noqa: BLE001 - the test inspects the error
        return {"error": type(err).__name__, "message": str(err)}
    opt = trainer.optimizers[0]
    return {"warnings": [str(w.message) for w in caught], "config": strategy.config.to_dict(),
            "precision": trainer.precision_plugin.precision, "accumulate": trainer.accumulate_grad_batches,
            "optimizer": type(opt).__name__, "betas": opt.param_groups[0]["betas"], "lrs": module.lrs,
            "losses": module.losses, "global_step": trainer.global_step}
