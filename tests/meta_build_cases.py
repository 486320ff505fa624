"""Models built with their parameters on the meta device (stage 3's configure_model / trainer.init_module, and
zero.Init) whose modules also make buffers and hand-initialized parameters in __init__ (tests/test_meta_build.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import ZeroConfig, ZeroStrategy, zero

SEQ, DIM, VOCAB = 8, 16, 23


class HandNorm(nn.Module):
    """nanoGPT's LayerNorm: parameters from torch.ones / torch.zeros, no reset_parameters."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class MaskedAttention(nn.Module):
    """nanoGPT's causal self-attention: the mask is a buffer computed in __init__; no parameters of its own."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.register_buffer("mask", torch.tril(torch.ones(SEQ, SEQ)).view(1, SEQ, SEQ))
        self.register_buffer("scale", torch.tensor(dim ** -0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        att = (q @ k.transpose(-2, -1)) * self.scale
        att = att.masked_fill(self.mask[:, :x.shape[1], :x.shape[1]] == 0, float("-inf")).softmax(-1)
        return self.proj(att @ v)


class NanoLM(nn.Module):
    def __init__(self, random_param: bool = False, scaled_init: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([nn.ModuleDict({"norm": HandNorm(DIM), "attn": MaskedAttention(DIM)})
                                     for _ in range(2)])
        self.norm = HandNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("positions", torch.arange(SEQ).float().div(SEQ).unsqueeze(-1))
        # a parameter drawn at construction (its own module, no reset_parameters): kept as drawn
        self.bump = nn.Parameter(torch.randn(DIM) * 0.02 if random_param else torch.full((DIM,), 0.01))
        if scaled_init:  # nanoGPT's scaled init of the residual projections, in the model's own __init__
            for name, p in self.named_parameters():
                if name.endswith("proj.weight"):
                    nn.init.normal_(p, std=0.02 / 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.positions[:idx.shape[1]] + self.bump
        for block in self.blocks:
            x = x + block["attn"](block["norm"](x))
        return self.head(self.norm(x))


def data() -> DataLoader:
    g = torch.Generator().manual_seed(5)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (24, SEQ + 1), generator=g)), batch_size=4)


class Built(pl.LightningModule):
    def __init__(self, random_param: bool = False, scaled_init: bool = False) -> None:
        super().__init__()
        self.random_param, self.scaled_init = random_param, scaled_init
        self.losses: list[float] = []
        self.lr = 0.0 if random_param else 1e-2

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            self.net = NanoLM(self.random_param, self.scaled_init)
            self.drawn = self.net.bump.detach().cpu().clone()  # this rank's draw (not on the meta device)

    def training_step(self, batch, batch_idx):
        idx = batch[0]
        logits = self.net(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def fit_case(rank: int, world: int, strategy: str, random_param: bool = False, real_init_bytes: int = 2**22,
             scaled_init: bool = False) -> dict:
    pl.seed_everything(rank if random_param else 0, verbose=False)  # random_param: each rank draws its own
    chosen = (DDPStrategy() if strategy == "ddp"
              else ZeroStrategy(config=ZeroConfig(stage=3, min_group_params=1, param_persistence_threshold=0,
                                                  real_init_bytes=real_init_bytes)))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=chosen, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = Built(random_param, scaled_init)
    trainer.fit(module, data())
    state = (trainer.strategy.full_state_dict(rank0_only=False) if strategy != "ddp"
             else {k: v.detach().cpu().clone() for k, v in module.state_dict().items()})
    return {"losses": module.losses, "state": state, "drawn": module.drawn}


class ForgetsOne(nn.Module):
    """reset_parameters sets the weight and forgets the bias."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.bias = nn.Parameter(torch.empty(4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


def zero_init_case(rank: int, world: int, forgets: bool = False) -> dict:
    """DeepSpeed-style: zero.Init, then initialize; the buffers made in __init__ keep their values."""
    torch.manual_seed(0)
    with zero.Init():
        model = nn.Sequential(ForgetsOne()) if forgets else NanoLM()
    try:
        engine, optimizer, _, _ = lightning_zero.initialize(
            model=model, config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
                                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    except RuntimeError as err:
        return {"error": str(err)}
    idx = next(iter(data()))[0]
    loss = nn.functional.cross_entropy(engine(idx[:, :-1]).reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    return {"loss": float(loss), "mask": model.blocks[0]["attn"].mask.cpu().clone(),
            "positions": model.positions.cpu().clone()}
