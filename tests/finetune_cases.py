"""Trainable sets that change during training: Lightning's BackboneFinetuning, and a parameter
group a user adds by hand after setup; with a checkpoint saved after the change and resumed."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from dist_utils import trained_state
from lightning.pytorch.callbacks import BackboneFinetuning
from model_zoo import DIM, VOCAB, Block, zoo_data, zoo_strategy
from torch import nn

import lightning_zero


class FinetuneLM(pl.LightningModule):
    """``backbone`` (what BackboneFinetuning unfreezes), a trainable head, and ``extra``: trainable
    from the start but only added to the optimizer at epoch 1 (``add_param_group`` by hand)."""

    def __init__(self, by_hand: bool) -> None:
        super().__init__()
        self.by_hand = by_hand
        self.emb = nn.Embedding(VOCAB, DIM)
        self.backbone = nn.Sequential(*[Block() for _ in range(3)])
        # (only with by_hand: Lightning's filter_on_optimizer compares parameters by value, so fresh
        # LayerNorm weights here would hide the backbone's from BackboneFinetuning under DDP)
        self.extra = Block() if by_hand else nn.Identity()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.losses: list[float] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.backbone(self.emb(idx))
        if self.by_hand:
            x = self.extra(x)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        loss = nn.functional.cross_entropy(self(idx[:, :-1]).reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def on_train_epoch_start(self):
        if self.by_hand and self.current_epoch == 1:
            self._add_group(self.trainer.optimizers[0])

    def on_load_checkpoint(self, checkpoint):
        # as under DDP, the saved optimizer state has two groups: add the second before it loads
        self.resume_with_extra = self.by_hand and len(checkpoint["optimizer_states"][0]["param_groups"]) > 1

    def _add_group(self, optimizer) -> None:
        if len(optimizer.param_groups) == 1:
            optimizer.add_param_group({"params": list(self.extra.parameters()), "lr": 5e-3})

    def configure_optimizers(self):
        later = self.extra if self.by_hand else self.backbone  # parameters added to the optimizer later
        skip = {id(p) for p in later.parameters()}
        params = [p for p in self.parameters() if id(p) not in skip]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        if getattr(self, "resume_with_extra", False):
            self._add_group(optimizer)
        return optimizer


class FreezeAfterWrap(BackboneFinetuning):
    """The DDP reference: DDP never synchronizes parameters that were frozen when it wrapped the model
    (with BackboneFinetuning its ranks drift apart once the backbone is unfrozen), so the reference
    freezes the backbone after wrapping: same training, correct under DDP."""

    def setup(self, trainer, pl_module, stage):
        pass

    def on_train_start(self, trainer, pl_module):
        if trainer.current_epoch < self.unfreeze_backbone_at_epoch:
            self.freeze_before_training(pl_module)


class UnfreezeOnResume(BackboneFinetuning):
    """Lightning's callback as is, except that a run resumed after the unfreeze epoch trains the
    backbone again (the stock one restores the param groups but leaves the backbone frozen)."""

    def on_fit_start(self, trainer, pl_module):
        restarting = self._restarting
        super().on_fit_start(trainer, pl_module)
        if restarting and len(self._internal_optimizer_metadata.get(0, [])) > 1:
            self.make_trainable(pl_module.backbone)


def _trainer(world: int, strategy: str, epochs: int, by_hand: bool, root: str) -> pl.Trainer:
    finetuning = FreezeAfterWrap if strategy.startswith("ddp") else UnfreezeOnResume
    callbacks = [] if by_hand else [finetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 1.5)]
    return pl.Trainer(accelerator="cpu", devices=world, strategy=zoo_strategy(strategy), max_epochs=epochs,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=root)


def finetune_case(rank: int, world: int, strategy: str, by_hand: bool, ckpt_dir: str) -> dict:
    """Three epochs straight; and two epochs, save, resume for the third."""
    assert lightning_zero
    pl.seed_everything(0, verbose=False)
    straight = FinetuneLM(by_hand)
    straight_trainer = _trainer(world, strategy, 3, by_hand, ckpt_dir)
    straight_trainer.fit(straight, zoo_data())
    pl.seed_everything(0, verbose=False)
    first = FinetuneLM(by_hand)
    trainer = _trainer(world, strategy, 2, by_hand, ckpt_dir)
    trainer.fit(first, zoo_data())
    path = f"{ckpt_dir}/{strategy}_{by_hand}.ckpt"
    trainer.save_checkpoint(path)
    pl.seed_everything(0, verbose=False)
    resumed = FinetuneLM(by_hand)
    resumed_trainer = _trainer(world, strategy, 3, by_hand, ckpt_dir)
    resumed_trainer.fit(resumed, zoo_data(), ckpt_path=path)
    return {"straight": {"losses": straight.losses, "state": trained_state(straight_trainer, straight)},
            "resumed": {"losses": first.losses + resumed.losses, "state": trained_state(resumed_trainer, resumed)}}


def finetune_many(rank: int, world: int, runs: list, ckpt_dir: str) -> dict:
    return {(s, h): finetune_case(rank, world, s, h, ckpt_dir) for s, h in runs}
