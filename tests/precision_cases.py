"""Mixed precision with several optimizers after one backward (manual optimization), against a
DDP reference written the way torch documents it (autocast + one GradScaler for all optimizers)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from dist_utils import trained_state
from model_zoo import DIM, VOCAB, Block, zoo_data, zoo_strategy
from torch import nn

import lightning_zero
from lightning_zero import ZeroPrecision

CLIP = 0.05  # small enough that both optimizers' gradients are clipped at every step
SCALE = 2.0**12


class TwoOptimizerLM(pl.LightningModule):
    """Body (embedding + blocks) and head in two optimizers, clipped separately, one backward."""

    def __init__(self, reference: bool, fp16: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.reference = reference  # True: DDP with autocast and torch's GradScaler by hand
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000, enabled=fp16) if reference else None
        self.fp16 = fp16
        self.losses: list[float] = []
        self.norms: list[tuple[float, float]] = []

    def _body(self) -> list[nn.Parameter]:
        return [*self.emb.parameters(), *self.blocks.parameters(), *self.norm.parameters()]

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        body_opt, head_opt = self.optimizers()
        if self.reference:
            with torch.autocast("cpu", dtype=torch.float16, enabled=self.fp16):
                logits = self.head(self.norm(self.blocks(self.emb(idx[:, :-1]))))
        else:
            logits = self.head(self.norm(self.blocks(self.emb(idx[:, :-1]))))
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))
        if self.reference:
            self.manual_backward(self.scaler.scale(loss))  # through the strategy: DDP synchronizes
            norms = []
            for opt, params in ((body_opt.optimizer, self._body()), (head_opt.optimizer, list(self.head.parameters()))):
                self.scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, CLIP)
                norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in params])))  # after clipping
            self.scaler.step(body_opt.optimizer)
            self.scaler.step(head_opt.optimizer)
            self.scaler.update()
        else:
            self.manual_backward(loss)
            self.clip_gradients(body_opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            self.clip_gradients(head_opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            engine = self.trainer.strategy.engine  # after clipping, over every rank's shard
            norms = [float(engine.grad_norm(opt.optimizer)) for opt in (body_opt, head_opt)]
            body_opt.step()
            head_opt.step()
        self.norms.append(tuple(norms))
        body_opt.zero_grad()
        head_opt.zero_grad()

    def configure_optimizers(self):
        return (torch.optim.AdamW(self._body(), lr=1e-2, weight_decay=0.1),
                torch.optim.SGD(self.head.parameters(), lr=0.5, momentum=0.9))


def two_optimizer_case(rank: int, world: int, strategy: str, fp16: bool = True) -> dict:
    assert lightning_zero
    pl.seed_everything(0, verbose=False)
    reference = strategy.startswith("ddp")
    module = TwoOptimizerLM(reference, fp16)
    plugins = None if reference or not fp16 else [ZeroPrecision("16-mixed")]
    options = {} if reference else dict(initial_scale_power=12)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=zoo_strategy(strategy, **options),
                         plugins=plugins, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, zoo_data())
    scale = module.scaler.get_scale() if reference else trainer.precision_plugin.loss_scale
    return {"losses": module.losses, "norms": module.norms, "scale": scale,
            "state": trained_state(trainer, module)}


def two_optimizer_many(rank: int, world: int, strategies: list[str], fp16: bool = True) -> dict:
    return {s: two_optimizer_case(rank, world, s, fp16) for s in strategies}


class WindowSumLM(pl.LightningModule):
    """A gradient of 1.5 per micro-batch, halved by accumulation 2 and scaled by 2**16: 49,152 per micro-batch
    fits fp16, the window's sum (98,304) does not, and neither does the reduced average."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1, bias=False)
        self.applied: list = []

    def training_step(self, batch, batch_idx):
        return 1.5 * self.lin(batch[0]).float().sum()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if (batch_idx + 1) % 2 == 0:
            self.applied.append(self.trainer.strategy.step_applied(self.optimizers().optimizer))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def window_sum_case(rank: int, world: int, stage: int) -> dict:
    """fp16 with accumulation 2 (see WindowSumLM): which steps were applied, and the final weight."""
    assert lightning_zero
    pl.seed_everything(0, verbose=False)
    module = WindowSumLM()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(16, 4)), batch_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=world, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                         strategy=f"zero{stage}", plugins=[ZeroPrecision("16-mixed")])
    trainer.fit(module, data)
    return {"applied": module.applied, "state": trained_state(trainer, module)}


def window_sum_many(rank: int, world: int) -> dict:
    return {stage: window_sum_case(rank, world, stage) for stage in (1, 2, 3)}
