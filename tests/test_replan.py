"""zero_auto out of GPU memory in its first step: it plans again with room for what was asked and trains on,
without losing the step (the same weights as a run that never ran out). One rank, in this process; the
"GPU" is the planner's model of one (a small budget), and the module raises torch's out-of-memory error
whenever the placement the strategy runs would not leave it the activation memory it needs."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import planner
from lightning_zero.replan import OOM, requested_bytes

ACTIVATIONS = 32 * 2**20
N_PARAMS = 1024 * 2048 + 2048 + 2048 + 1  # the MLP below: 2.1M parameters, 25 MB of fp32 AdamW state


class NeedsActivationRoom(pl.LightningModule):
    def __init__(self, hw=None, where: str = "forward") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1))
        self.hw, self.where, self.ooms, self.losses = hw, where, 0, []

    def _check(self) -> None:
        strategy = self.trainer.strategy
        if self.hw is None or not hasattr(strategy, "config"):
            return
        row = planner.estimate(N_PARAMS, strategy.config, self.hw, compute_bytes=4)
        if row.gpu_total + ACTIVATIONS > row.gpu_total_cap:
            self.ooms += 1
            raise OOM(f"CUDA out of memory. Tried to allocate {ACTIVATIONS / 2**20:.2f} MiB. GPU 0 has ...")

    def training_step(self, batch, batch_idx):
        if self.where == "forward":
            self._check()
        loss = self.net(batch[0]).pow(2).mean()
        if self.where == "backward":
            loss.register_hook(lambda grad: self._check())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(strategy, module, steps=4):
    assert lightning_zero
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)  # the same batches under every strategy
    g = torch.Generator().manual_seed(1)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(32, 1024, generator=g)), batch_size=8))
    return trainer


def _small_gpu() -> planner.Hardware:
    """A budget in which zero2 fits without activations but not with them, and offloading fits with them."""
    plain = planner.estimate(N_PARAMS, lightning_zero.ZeroConfig(stage=2), planner.Hardware(), compute_bytes=4)
    return planner.Hardware(gpu_bytes=int((plain.gpu_total + ACTIVATIONS // 4) / planner.HEADROOM),
                            host_bytes=64 * 2**30)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_in_the_first_step_plans_again_and_loses_no_step(monkeypatch, where):
    hw = _small_gpu()
    monkeypatch.setattr(planner, "hardware_here", lambda *args, **kwargs: hw)
    pl.seed_everything(0, verbose=False)
    module = NeedsActivationRoom(hw, where)
    with pytest.warns(UserWarning, match="out of GPU memory in the first step under zero2; planned again"):
        trainer = _fit("zero_auto", module)
    assert module.ooms == 1 and trainer.strategy.config.offloads and trainer.global_step == 4
    pl.seed_everything(0, verbose=False)
    reference = NeedsActivationRoom()
    _fit("auto", reference)  # plain single-device training
    got = {k: v.detach() for k, v in module.state_dict().items()}
    for name, value in reference.state_dict().items():
        assert torch.allclose(got[name], value, rtol=1e-5, atol=1e-6), name
    assert module.losses[-4:] == pytest.approx(reference.losses, rel=1e-5)  # the same four steps


def test_out_of_memory_after_the_first_step_is_not_hidden(monkeypatch):
    hw = _small_gpu()
    monkeypatch.setattr(planner, "hardware_here", lambda *args, **kwargs: hw)

    class LateOOM(NeedsActivationRoom):
        def training_step(self, batch, batch_idx):
            if self.global_step == 2:
                raise OOM("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super().training_step(batch, batch_idx)

    with pytest.raises(OOM, match="Tried to allocate 2.00 GiB"):
        _fit("zero_auto", LateOOM(None))


def test_requested_bytes_is_read_from_torch_messages():
    assert requested_bytes("CUDA out of memory. Tried to allocate 1.50 GiB (GPU 0; 79.1 GiB total)") == int(1.5 * 2**30)
    assert requested_bytes("Tried to allocate 20.00 MiB") == 20 * 2**20
    assert requested_bytes("out of memory") == 0
