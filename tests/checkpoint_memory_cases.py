"""Host memory of sharded save and restore, measured as RSS on each rank (test_checkpoint_memory.py).

The model is 36 bias-free 1024x1024 layers (37.7M parameters) trained with AdamW: its full
training state (fp32 weights + two moments) is 12 bytes a parameter, 453 MB. A sampler thread
reads the process's resident set every 2 ms; the growth of an operation is its peak minus the
resident set just before it. Save: ``trainer.save_checkpoint`` during training (as
ModelCheckpoint calls it). Restore: a new Trainer's ``fit(ckpt_path=...)`` from just before the
call (the user's model already built) until training starts (weights and optimizer state loaded).
"""

from __future__ import annotations

import gc
import os
import threading
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import ZeroStrategy

WIDTH, DEPTH = 1024, 36
STATE_BYTES = 12 * WIDTH * WIDTH * DEPTH


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Highest resident set between ``start()`` and ``stop()``, sampled every 2 ms."""

    def start(self) -> None:
        gc.collect()
        self.base = self.peak = rss()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def stop(self) -> float:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, rss())
        return (self.peak - self.base) / STATE_BYTES


class DeepMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)])

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.layers(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class _SaveDuringTraining(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, *args):
        probe = PeakRSS()
        probe.start()
        trainer.save_checkpoint(self.path)
        self.growth = probe.stop()


class _ReadsCheckpoint(Callback):
    """A hook that sees the checkpoint dict: the strategy then builds its DTensors (a host copy of the share)."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        assert checkpoint["state_dict"]


class _StopProbeAtTrainStart(Callback):
    def __init__(self, probe: PeakRSS) -> None:
        self.probe = probe

    def on_train_start(self, trainer, pl_module):
        self.growth = self.probe.stop()


def _trainer(stage: int, fmt: str, steps: int, callbacks: list) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=stage, checkpoint_format=fmt),
                      max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=callbacks)


def _data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, WIDTH)), batch_size=2)


def memory_case(rank: int, world: int, d: str) -> dict:
    assert lightning_zero
    torch.set_num_threads(1)
    out = {}
    for stage in (2, 3):
        for fmt in ("sharded", "full"):
            path = f"{d}/s{stage}_{fmt}.ckpt"
            save = _SaveDuringTraining(path)
            trainer = _trainer(stage, fmt, 1, [save])
            trainer.fit(DeepMLP(), _data())
            del trainer
            gc.collect()
            module = DeepMLP()
            probe = PeakRSS()
            stop = _StopProbeAtTrainStart(probe)
            trainer = _trainer(stage, fmt, 2, [stop])
            probe.start()
            trainer.fit(module, _data(), ckpt_path=path)
            out[(stage, fmt)] = {"save": save.growth, "restore": stop.growth}
            del trainer, module
            gc.collect()
    save = _SaveDuringTraining(f"{d}/s3_hook.ckpt")
    trainer = _trainer(3, "sharded", 1, [save, _ReadsCheckpoint()])
    trainer.fit(DeepMLP(), _data())
    out[(3, "sharded, hook reads dict")] = {"save": save.growth, "restore": float("nan")}
    del trainer
    gc.collect()
    return out
