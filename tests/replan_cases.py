"""zero_auto's measured first step on several ranks (tests/test_replan.py): every rank reads its own peak
(here a simulated GPU's figure, different per rank), the largest counts, rank 0 decides and every rank moves."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from test_replan import USED, SimulatedMeter, Wide, planner_margin
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import planner


def gpu_of_world(total: int):
    """hardware_here for nodes of simulated GPUs of ``total`` bytes each (the share zero_auto keeps honoured)."""
    def here(device, gpus_per_node, nodes, config, activation_share=planner.ACTIVATION_SHARE, host_returning=0):
        return planner.Hardware(gpus_per_node=gpus_per_node, nodes=nodes, gpu_bytes=int(total * (1 - activation_share)),
                                host_bytes=64 * 2**30)
    return here


class Wider(Wide):
    """Wide with twice the first layer's width and 38M parameters: over two ranks zero2 still needs the share."""

    def __init__(self) -> None:
        super().__init__(None)
        self.net = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 8192), nn.ReLU(),
                                 nn.Linear(8192, 1))


N_PARAMS = sum(p.numel() for p in Wider().parameters())


def probe_gpu(world: int) -> int:
    """A GPU on which zero2 over ``world`` ranks does not fit while a quarter is kept for activations, and fits
    with what the first step measured (with the margin)."""
    hw = planner.Hardware(gpus_per_node=world)
    z2 = planner.estimate(N_PARAMS, lightning_zero.ZeroConfig(stage=2), hw, compute_bytes=4)
    total = int((z2.gpu_total + int(planner_margin(USED) * 1.05)) / planner.HEADROOM)
    assert z2.gpu_total > (1 - planner.ACTIVATION_SHARE) * total * planner.HEADROOM, "the share must rule zero2 out"
    return total


def _fit(module, strategy, meter=None):
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    if meter is not None:
        trainer.strategy._auto.replanner.meter = meter
    g = torch.Generator().manual_seed(1)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(32, 1024, generator=g)), batch_size=8))
    return trainer


def measured_on_two_ranks(rank: int, world: int) -> dict:
    planner.hardware_here = gpu_of_world(probe_gpu(world))
    first = planner.choose(N_PARAMS, planner.hardware_here(None, world, 1, None), lightning_zero.ZeroConfig(),
                           compute_bytes=4).name
    pl.seed_everything(0, verbose=False)
    module = Wider()
    # rank 1's first step peaks higher: the plan must use the largest figure, on every rank
    trainer = _fit(module, "zero_auto", SimulatedMeter(USED if rank == 1 else USED // 4))
    state = trainer.strategy.full_state_dict(rank0_only=False)
    out = {"first": first, "config": trainer.strategy.config.to_dict(), "measured": trainer.strategy._auto.replanner.measured,
           "losses": list(module.losses), "state": {k: v.clone() for k, v in state.items()}}
    pl.seed_everything(0, verbose=False)
    reference = Wider()
    ref = _fit(reference, lightning_zero.ZeroStrategy(stage=2))
    out["reference_losses"] = list(reference.losses)
    out["reference"] = {k: v.clone() for k, v in ref.strategy.full_state_dict(rank0_only=False).items()}
    return out
