"""Gradient norms in ``on_before_optimizer_step`` (tests/test_grad_norm.py): DDP's ``grad_norm(module, p)`` against
``trainer.strategy.grad_norm(p)`` and Lightning's own ``grad_norm`` (imported above, before any engine existed) of
the module and of a submodule under the engine, whose parameters hold no ``.grad`` there."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader

import lightning_zero


class Logged(pl.LightningModule):
    def __init__(self, norm_type: float, via: str = "strategy") -> None:
        super().__init__()
        self.norm_type, self.via = norm_type, via
        self.body = nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh())
        self.head = nn.Linear(40, 1)
        self.unused = nn.Linear(3, 3)  # never gets a gradient: no entry, as under DDP
        self.seen: list[dict[str, float]] = []

    def training_step(self, batch, batch_idx):
        return self.head(self.body(batch[0])).pow(2).mean()

    def on_before_optimizer_step(self, optimizer):
        if isinstance(self.trainer.strategy, lightning_zero.ZeroStrategy) and self.via == "strategy":
            norms = self.trainer.strategy.grad_norm(self.norm_type)
        else:
            norms = grad_norm(self, self.norm_type)
        body = {f"body:{k}": v for k, v in grad_norm(self.body, self.norm_type, group_separator=":").items()}
        self.seen.append({k: float(v) for k, v in {**norms, **body}.items()})

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def fit(rank: int, world: int, strategy: str, norm_type: float, via: str = "strategy") -> dict:
    torch.manual_seed(0)
    model = Logged(norm_type, via)
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
    return {"seen": model.seen, "warned": any("grad_norm(module, 2)" in str(w.message) for w in caught)}


class TorchClipped(pl.LightningModule):
    """Manual optimization clipped with torch's ``clip_grad_norm_`` over the module's parameters plus a tensor outside
    it (a learned temperature kept as a plain attribute: no engine holds it and DDP does not sync it, so every rank
    sees the same batches), then ``clip_grad_value_``."""

    def __init__(self, norm_type: float) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.norm_type = norm_type
        self.body = nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 1))
        self.outside = torch.ones(1, requires_grad=True)
        self.norms: list[float] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.outside.grad = None
        self.manual_backward((self.body(batch[0]) * self.outside).pow(2).mean())
        params = [*self.parameters(), self.outside]
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.05, norm_type=self.norm_type)))
        torch.nn.utils.clip_grad_value_(self.parameters(), 0.004)
        opt.step()
        with torch.no_grad():
            self.outside -= 0.1 * self.outside.grad

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def fit_torch_clipped(rank: int, world: int, strategy: str, norm_type: float) -> dict:
    torch.manual_seed(0)
    model = TorchClipped(norm_type)
    chosen = lightning_zero.ZeroStrategy(stage=int(strategy[4]), min_group_params=50, param_persistence_threshold=0,
                                         offload_optimizer="cpu" if "offload" in strategy else "none") \
        if strategy != "ddp" else pl.strategies.DDPStrategy()
    g = torch.Generator().manual_seed(0)  # the same batches on every rank: the outside tensor's gradient agrees
    data = DataLoader([(torch.randn(6, generator=g),) for _ in range(12)], batch_size=3)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=chosen, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    trainer.fit(model, data)
    state = (trainer.strategy.full_state_dict(rank0_only=False) if strategy != "ddp"
             else model.state_dict())
    # torch's own behaviour for tensors no engine holds, with an engine alive in the process
    plain = nn.Linear(4, 4)
    plain(torch.ones(2, 4)).sum().backward()
    reference = [p.grad.clone() for p in plain.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    expected = torch.nn.utils.get_total_norm(reference)
    return {"norms": model.norms, "outside": float(model.outside), "state": {k: v.float().clone() for k, v in state.items()},
            "plain_norm": float(norm), "plain_expected": float(expected),
            "plain_clipped": max(float(p.grad.norm()) for p in plain.parameters())}
