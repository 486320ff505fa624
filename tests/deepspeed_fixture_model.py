"""The model and data behind the DeepSpeed checkpoint fixtures (tests/fixtures/deepspeed.tar.gz): written
by DeepSpeed itself on a GPU (tests/fixtures/make_deepspeed_fixtures.py), read here on CPU without it."""

from __future__ import annotations

import torch
from torch import nn

OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01,
                                         "torch_adam": True}}
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}}
STEPS = 3


class Net(nn.Module):
    """Tied embedding and head, a LayerNorm, a BatchNorm (buffers), odd sizes (padding in every layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 7)
        self.fc = nn.Linear(7, 11)
        self.norm = nn.LayerNorm(11)
        self.bn = nn.BatchNorm1d(11)
        self.out = nn.Linear(11, 7)
        self.head = nn.Linear(7, 13, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).mean(1)
        x = torch.tanh(self.norm(self.fc(x)))
        bn, stats = self.bn, self.bn.running_mean.dtype  # bf16 runs: the statistics may keep another dtype
        x = nn.functional.batch_norm(x.to(stats), bn.running_mean, bn.running_var, bn.weight.to(stats),
                                     bn.bias.to(stats), self.training, bn.momentum, bn.eps)
        return self.head(self.out(x.to(self.out.weight.dtype)))


def build(frozen: bool = False) -> Net:
    """``frozen``: ``fc`` does not train (DeepSpeed keeps it apart, as frozen parameters)."""
    torch.manual_seed(0)
    net = Net()
    if frozen:
        net.fc.requires_grad_(False)
    return net


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 13, (4, 5), generator=g), torch.randint(0, 13, (4,), generator=g)


def loss_of(model: nn.Module, step: int, rank: int, device: torch.device) -> torch.Tensor:
    idx, target = (t.to(device) for t in batch(step, rank))
    return nn.functional.cross_entropy(model(idx).float(), target)
