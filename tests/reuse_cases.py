"""A module trained under stage 3, then given to a new Trainer with ckpt_path (tests/test_reuse.py), and predict
on a dataset that does not split evenly over the ranks."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroConfig, ZeroStrategy


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 1, generator=g))


def _strategy(name: str):
    if name == "ddp":
        return "ddp"
    return ZeroStrategy(config=ZeroConfig(stage=int(name[-1]), wrap_modules=("Linear",), param_persistence_threshold=0))


def _trainer(strategy: str, world: int, **kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=world, strategy=_strategy(strategy), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def reuse_case(rank: int, world: int, first: str, second: str, what: str, path: str) -> dict:
    """fit under ``first``, save; a new Trainer under ``second`` gets the same module and ``ckpt_path``."""
    pl.seed_everything(0, verbose=False)
    module = Net()
    train, val = DataLoader(_data(64, 0), batch_size=4), DataLoader(_data(16, 1), batch_size=4)
    trainer = _trainer(first, world, max_epochs=1, limit_train_batches=4)
    trainer.fit(module, train, val)
    trainer.save_checkpoint(path)
    again = _trainer(second, world, max_epochs=2, limit_train_batches=4)
    out = {}
    if what == "fit":
        again.fit(module, train, val, ckpt_path=path)
        out["step"] = again.global_step
    else:
        out["val"] = again.validate(module, val, ckpt_path=path, verbose=False)[0]["val_loss"]
    state = (again.strategy.full_state_dict(rank0_only=False) if second != "ddp" else module.state_dict())
    out["state"] = {k: v.detach().cpu().clone() for k, v in state.items()}
    return out


def predict_case(rank: int, world: int, strategy: str, n: int) -> dict:
    """predict after fit on ``n`` samples (Lightning's predict sampler does not pad: ranks may get fewer)."""
    pl.seed_everything(0, verbose=False)
    module = Net()
    trainer = _trainer(strategy, world, max_steps=3)
    trainer.fit(module, DataLoader(_data(32, 0), batch_size=4))
    out = trainer.predict(module, DataLoader(_data(n, 2), batch_size=1))
    return {"predictions": torch.cat(out).flatten().tolist()}
