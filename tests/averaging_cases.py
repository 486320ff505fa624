"""Lightning's weight-averaging callbacks (SWA, EMA) on 2 ranks (tests/test_averaging.py): each rank returns the
training losses, the validation losses (EMA validates with the average swapped in) and the final full state."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from dist_utils import trained_state
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import ZeroStrategy

# stage 3 with every Linear a group of its own and nothing persistent: every parameter is sharded between steps
SHARDED = dict(stage=3, min_group_params=50, param_persistence_threshold=0)


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch, _):
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.losses.append(float(loss))
        return loss

    def validation_step(self, batch, _):
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.val_losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _data(seed: int, n: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)), batch_size=4)


def _callback(kind: str) -> list[pl.Callback]:
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    if kind == "none":
        return []

    if kind == "swa":
        return [StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=1)]
    from lightning.pytorch.callbacks import EMAWeightAveraging

    return [EMAWeightAveraging(decay=0.9)]


def fit_averaged(rank: int, world: int, strategy: str, kind: str, precision: str = "32-true") -> dict:
    assert lightning_zero
    pl.seed_everything(0, verbose=False)
    module = Net()
    trainer = pl.Trainer(strategy=ZeroStrategy(**SHARDED) if strategy == "zero3_sharded" else strategy,
                         accelerator="cpu", devices=world, max_epochs=3, callbacks=_callback(kind),
                         precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, _data(0, 32), _data(1, 16))
    return {"losses": module.losses, "val_losses": module.val_losses, "state": trained_state(trainer, module)}


def run_all(rank: int, world: int, runs: list[tuple[str, str, str]]) -> dict:
    return {run: fit_averaged(rank, world, *run) for run in runs}


def _strategy(name: str, fmt: str):
    if name == "ddp":
        return "ddp"
    options = dict(SHARDED) if name == "zero3_sharded" else dict(stage=int(name[-1]))
    return ZeroStrategy(**options, checkpoint_format=fmt)


def fit_ema_resumed(rank: int, world: int, saver: str, loader: str, fmt: str, root: str) -> dict:
    """EMA over 2 epochs with ModelCheckpoint(save_last) under ``saver``, then a third epoch resumed from it under
    ``loader``: the resumed losses and the final (averaged) state."""
    from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint

    directory = f"{root}/{saver}_{loader}_{fmt}"
    common = dict(accelerator="cpu", devices=world, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(strategy=_strategy(saver, fmt), max_epochs=2, **common,
                         callbacks=[EMAWeightAveraging(decay=0.9), ModelCheckpoint(dirpath=directory, save_last=True)])
    trainer.fit(Net(), _data(0, 32), _data(1, 16))
    pl.seed_everything(1, verbose=False)  # another initialisation: every weight must come from the checkpoint
    module = Net()
    trainer = pl.Trainer(strategy=_strategy(loader, fmt), max_epochs=3, callbacks=[EMAWeightAveraging(decay=0.9)],
                         enable_checkpointing=False, **common)
    trainer.fit(module, _data(0, 32), _data(1, 16), ckpt_path=f"{directory}/last.ckpt")
    return {"losses": module.losses, "val_losses": module.val_losses, "state": trained_state(trainer, module)}


def run_ema_resumed(rank: int, world: int, runs: list[tuple[str, str, str]], root: str) -> dict:
    return {run: fit_ema_resumed(rank, world, *run, root) for run in runs}
