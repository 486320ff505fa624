"""Gradient norms in ``on_before_optimizer_step`` (tests/test_grad_norm.py): DDP's ``grad_norm(module, p)`` against
``trainer.strategy.grad_norm(p)`` under the engine, whose parameters hold no ``.grad`` there."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader

import lightning_zero


class Logged(pl.LightningModule):
    def __init__(self, norm_type: float) -> None:
        super().__init__()
        self.norm_type = norm_type
        self.body = nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh())
        self.head = nn.Linear(40, 1)
        self.unused = nn.Linear(3, 3)  # never gets a gradient: no entry, as under DDP
        self.seen: list[dict[str, float]] = []

    def training_step(self, batch, batch_idx):
        return self.head(self.body(batch[0])).pow(2).mean()

    def on_before_optimizer_step(self, optimizer):
        if isinstance(self.trainer.strategy, lightning_zero.ZeroStrategy):
            norms = self.trainer.strategy.grad_norm(self.norm_type)
        else:
            norms = grad_norm(self, self.norm_type)
        self.seen.append({k: float(v) for k, v in norms.items()})

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def fit(rank: int, world: int, strategy: str, norm_type: float) -> dict:
    torch.manual_seed(0)
    model = Logged(norm_type)
    options = {"zero1": dict(stage=1), "zero2": dict(stage=2, reduce_bucket_size=500),
               "zero3": dict(stage=3, min_group_params=500, param_persistence_threshold=0),
               "zero2_offload": dict(stage=2, offload_optimizer="cpu", reduce_bucket_size=500)}
    chosen = (lightning_zero.ZeroStrategy(**options[strategy]) if strategy in options
              else pl.strategies.DDPStrategy(find_unused_parameters=True))
    data = DataLoader([(torch.randn(6),) for _ in range(24)], batch_size=3)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=chosen, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    return {"seen": model.seen, "warned": any("grad_norm(2)" in str(w.message) for w in caught)}
