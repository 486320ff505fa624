"""Layers that change their own weights in forward, run user pre-hooks on them, or mix parameters with buffers
(tests/test_layers.py): each trained on 2 gloo ranks under a ZeRO strategy and under DDP."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroConfig, ZeroStrategy

VOCAB = 40  # the tokens drawn
ROWS = 20_000


class Renorm(pl.LightningModule):
    """nn.Embedding(max_norm=1): every lookup renormalizes the rows it reads, in place, during forward."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, 6, max_norm=1.0)  # above the persistence threshold: sharded under zero3
        self.head = nn.Linear(6, 1)
        with torch.no_grad():
            self.emb.weight.mul_(3.0)  # most rows start above the norm
        self.lr, self.losses = lr, []

    def training_step(self, batch, batch_idx):
        loss = self.head(self.emb(batch[0])).pow(2).mean()
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Hooked(pl.LightningModule):
    """Layers whose own forward pre-hooks read their parameters: old-style weight_norm / spectral_norm, pruning."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        if kind == "weight_norm":
            self.inner = torch.nn.utils.weight_norm(self.inner)
        elif kind == "spectral_norm":
            self.inner = torch.nn.utils.spectral_norm(self.inner)
        else:
            torch.nn.utils.prune.random_unstructured(self.inner, "weight", amount=0.5)
        self.head = nn.Linear(8, 1)
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.head(torch.tanh(self.inner(batch[0]))).pow(2).mean()
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Parametrized(pl.LightningModule):
    """torch.nn.utils.parametrizations.spectral_norm (fp32 buffers in a torch.mv) and a float buffer added to the
    activations: both meet 16-bit parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.utils.parametrizations.spectral_norm(nn.Linear(8, 16))
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 1)
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, 8))
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.head(torch.tanh(self.norm(self.inner(batch[0] + self.offset)))).float().pow(2).mean()
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data(kind: str) -> DataLoader:
    g = torch.Generator().manual_seed(4)
    if kind == "tokens":
        return DataLoader(TensorDataset(torch.randint(0, VOCAB, (16, 5), generator=g)), batch_size=2)
    return DataLoader(TensorDataset(torch.randn(32, 8, generator=g)), batch_size=4)


def fit_case(rank: int, world: int, model: str, strategy: str, options: dict, precision: str = "32-true") -> dict:
    pl.seed_everything(0, verbose=False)
    module, data = {"renorm": (lambda: Renorm(0.1), "tokens"), "renorm_lr0": (lambda: Renorm(0.0), "tokens"),
                    "weight_norm": (lambda: Hooked("weight_norm"), "points"),
                    "spectral_norm": (lambda: Hooked("spectral_norm"), "points"),
                    "prune": (lambda: Hooked("prune"), "points"),
                    "parametrized": (Parametrized, "points")}[model]
    module = module()
    chosen = DDPStrategy() if strategy == "ddp" else ZeroStrategy(config=ZeroConfig(**options))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=chosen, max_steps=4, precision=precision,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         # a renorm under DDP edits each rank's own replica: the same batches keep them equal
                         use_distributed_sampler=not model.startswith("renorm"))
    trainer.fit(module, _data(data))
    state = (trainer.strategy.full_state_dict(rank0_only=False) if strategy != "ddp"
             else module.state_dict())
    return {"losses": module.losses, "state": {k: v.detach().float().cpu().clone() for k, v in state.items()}}


def engine_bf16_case(rank: int, world: int) -> dict:
    """The DeepSpeed-style engine in bf16 (autocast, 16-bit parameters) with BatchNorm and spectral_norm."""
    import lightning_zero

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8),
                          torch.nn.utils.parametrizations.spectral_norm(nn.Linear(8, 1)))
    engine, _, _, _ = lightning_zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    losses = []
    for step in range(2):
        loss = engine(torch.randn(4, 4, generator=torch.Generator().manual_seed(step))).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return {"losses": losses}


class FrozenBackbone(pl.LightningModule):
    """A frozen backbone and a trainable head: each rank should hold half of the head's optimizer state."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(*[nn.Linear(128, 128) for _ in range(3)]).requires_grad_(False)
        self.head = nn.Linear(128, 128)
        self.state_bytes = 0

    def training_step(self, batch, batch_idx):
        return self.head(torch.tanh(self.backbone(batch[0]))).pow(2).mean()

    def on_train_batch_start(self, batch, batch_idx):  # after the previous step: the optimizer state exists
        opt = self.optimizers().optimizer
        self.state_bytes = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values()
                               if isinstance(v, torch.Tensor) and v.dim() > 0)
        self.report = self.trainer.strategy.memory_report().as_dict()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.head.parameters(), lr=1e-3)


def frozen_balance_case(rank: int, world: int, stage: int) -> dict:
    pl.seed_everything(0, verbose=False)
    module = FrozenBackbone()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=ZeroStrategy(stage=stage), max_steps=3,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(32, 128)), batch_size=4))
    head = sum(p.numel() for p in module.head.parameters())
    return {"state_bytes": module.state_bytes, "head_state_bytes": 8 * head, "report": module.report}
