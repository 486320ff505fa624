"""Lightning's own callbacks that change weights, optimizer state or the accumulation during fit, run under each
strategy on N gloo ranks (tests/test_builtin_callbacks.py compares them with DDP).

- ``lr_finder``: ``LearningRateFinder`` trains a few steps at rising rates, then restores the checkpoint it saved
  before any step (its optimizer state is empty: every parameter must start fresh, as torch's ``load_state_dict``
  leaves it) and trains with the suggested rate.
- ``pruning``: ``ModelPruning`` with its default lottery-ticket reset, which gives each pruned weight new data
  (``p.data = copy.data``) at every epoch's end; under DDP that copy then *is* the parameter, so the next reset
  reads the trained values.
- ``accumulation``: ``GradientAccumulationScheduler`` changes the accumulation between epochs.
- ``replace``: a user callback that assigns new data to a parameter (``p.data = t``) and keeps ``t``.
- ``switch_optimizer``: a callback switches AdamW for SGD with momentum at the second epoch
  (``trainer.strategy.setup_optimizers(trainer)`` after changing what ``configure_optimizers`` returns).
- ``reset_state``: a callback clears, zeroes and deletes the optimizer state of some parameters, reached by the
  module's parameters (``opt.state[p]``), at the second epoch.
- ``epoch_ends_mid_window``: ``on_train_batch_start`` returning -1 ends the first epoch inside an accumulation
  window; the next window's ``zero_grad`` drops that partial gradient, wherever it is held (with offload, a device
  accumulator).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from dist_utils import trained_state
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, LearningRateFinder, ModelPruning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import ZeroConfig, ZeroStrategy


class Regressor(pl.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.blocks = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch, batch_idx):
        loss = (self(batch[0]) - batch[1]).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if getattr(self, "use_sgd", False):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 4, 0.5)}


class EndsEpochMidWindow(Regressor):
    def on_train_batch_start(self, batch, batch_idx):
        if self.current_epoch == 0 and batch_idx == 4:
            return -1
        return None


def data() -> DataLoader:
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4)


class ReplaceHeadData(Callback):
    """At each epoch's end the head's weight gets new data (half its values) by assignment; the tensor is kept, and
    what it holds at the end is recorded (under DDP it followed every later step)."""

    def __init__(self) -> None:
        self.given: list[torch.Tensor] = []

    def on_train_epoch_end(self, trainer, pl_module):
        weight = pl_module.head.weight
        values = weight.detach().clone() if weight.numel() else None
        if values is None:  # a stage-3 placeholder: the values come from the engine's gather
            with lightning_zero.zero.GatheredParameters([weight]):
                values = weight.detach().clone()
        weight.data = values * 0.5
        self.given.append(weight.data)


class SwitchToSGD(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.use_sgd = True
            trainer.strategy.setup_optimizers(trainer)


class ResetStateByParameter(Callback):
    """At the second epoch's start the head restarts Adam (``if p in opt.state: opt.state[p].clear()``), the first
    block's weight keeps its step count but loses its first moment (``opt.state[p]["exp_avg"].zero_()``) and its
    bias's state is deleted (``del opt.state[p]``): state reached by the module's parameters, as under DDP."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch != 1:
            return
        state = trainer.optimizers[0].state
        for p in pl_module.head.parameters():
            if p in state:
                state[p].clear()
        state[pl_module.blocks[0].weight]["exp_avg"].zero_()
        if pl_module.blocks[0].bias in state:
            del state[pl_module.blocks[0].bias]


def _strategy(name: str):
    if name == "ddp":
        return "ddp"
    offload = name.endswith("_offload")
    stage = int(name[4])
    return ZeroStrategy(config=ZeroConfig(stage=stage, reduce_bucket_size=300, min_group_params=200,
                                          offload_optimizer="cpu" if offload else "none"))


def callback_case(rank: int, world: int, strategy: str, case: str, root: str) -> dict:
    pl.seed_everything(0, verbose=False)
    module = EndsEpochMidWindow() if case == "epoch_ends_mid_window" else Regressor()
    replace = ReplaceHeadData()
    callbacks = {"lr_finder": [LearningRateFinder(num_training_steps=8, min_lr=1e-4, max_lr=1e-1)],
                 "pruning": [ModelPruning("l1_unstructured", amount=0.3)],
                 "accumulation": [GradientAccumulationScheduler({0: 1, 1: 3, 2: 2})],
                 "replace": [replace], "epoch_ends_mid_window": [],
                 "switch_optimizer": [SwitchToSGD()], "reset_state": [ResetStateByParameter()]}[case]
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=_strategy(strategy), max_epochs=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=root,
                         accumulate_grad_batches=3 if case == "epoch_ends_mid_window" else 1)
    trainer.fit(module, data())
    out = {"losses": module.losses, "state": trained_state(trainer, module), "steps": trainer.global_step,
           "lr": trainer.optimizers[0].param_groups[0]["lr"], "optimizer": type(trainer.optimizers[0]).__name__}
    if case == "replace":
        out["given"] = [t.detach().float().clone() for t in replace.given]
    return out


def callback_many(rank: int, world: int, runs: list, root: str) -> dict:
    return {(s, c): callback_case(rank, world, s, c, root) for s, c in runs}
