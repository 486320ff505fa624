"""A Hugging Face GPT-2 as a LightningModule, trained with ``Trainer(strategy="zero3")``, configured by Hydra.

    python examples/hf_gpt2_lightning.py                                   # GPT-2 small layout, zero3
    python examples/hf_gpt2_lightning.py tiny=true out=/tmp/gpt2-trained   # CPU smoke run, 2 gloo ranks
    python examples/hf_gpt2_lightning.py strategy=zero2_offload checkpointing=true precision=bf16-mixed
    python examples/hf_gpt2_lightning.py deepspeed_config=examples/ds_config_gpt2.json

The configuration is a structured dataclass registered in Hydra's ConfigStore (no YAML): every field
below is a command-line override. The model is built from a ``GPT2Config`` (no download); needs
``pip install transformers`` (the ``hf`` extra). At the end the trained weights are gathered unit by
unit to rank 0 (``trainer.strategy.full_state_dict()``) and written with ``save_pretrained``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import hydra
import lightning.pytorch as pl
import torch
from hf_common import Windows, gpt2_config, save_pretrained
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig
from transformers import GPT2Config, GPT2LMHeadModel

import lightning_zero
from lightning_zero.train import resolve_devices


@dataclass
class RunConfig:
    tiny: bool = False                       # 2 layers x 64 instead of GPT-2 small's 12 x 768
    strategy: str = "zero3"                  # any registered name: zero1..3, zero2_offload, zero3_offload, ...
    deepspeed_config: Optional[str] = None   # a ds_config.json: overrides `strategy` with what it says
    accelerator: str = "auto"                # gpu when CUDA is available, else cpu
    devices: Any = "auto"                    # all GPUs, or 2 gloo processes on a CPU-only machine
    precision: str = "32-true"
    epochs: int = 3
    batch_size: int = 4
    accumulate: int = 2
    lr: float = 3e-3
    warmup_steps: int = 10
    checkpointing: bool = False              # HF gradient_checkpointing_enable(), reentrant
    out: Optional[str] = None                # save_pretrained directory (rank 0)
    seed: int = 0


ConfigStore.instance().store(name="hf_gpt2", node=RunConfig)


class CausalLM(pl.LightningModule):
    def __init__(self, config: GPT2Config, lr: float, warmup_steps: int, checkpointing: bool) -> None:
        super().__init__()
        self.lr, self.warmup_steps = lr, warmup_steps
        self.model = GPT2LMHeadModel(config)
        if checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        loss = self.trainer.callback_metrics.get("train/loss_epoch")
        self.print(f"epoch {self.current_epoch} loss {float(loss):.4f} (steps {self.global_step})")

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / self.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


@hydra.main(version_base="1.3", config_path=None, config_name="hf_gpt2")
def main(cfg: DictConfig) -> None:
    pl.seed_everything(cfg.seed)
    config = gpt2_config(cfg.tiny)
    module = CausalLM(config, cfg.lr, cfg.warmup_steps, cfg.checkpointing)
    accelerator, devices = resolve_devices(cfg.accelerator, cfg.devices, cpu_devices=2)
    strategy = lightning_zero.ZeroStrategy(deepspeed_config=cfg.deepspeed_config) if cfg.deepspeed_config \
        else cfg.strategy
    trainer = pl.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, precision=cfg.precision,
                         max_epochs=cfg.epochs, accumulate_grad_batches=cfg.accumulate, gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(Windows(), batch_size=cfg.batch_size)
    trainer.fit(module, loader)
    # stage 3 keeps the module sharded after fit: gather the weights (every rank takes part, rank 0 keeps them)
    state = trainer.strategy.full_state_dict()
    if cfg.out and trainer.is_global_zero:
        state = {k.removeprefix("model."): v for k, v in state.items()}
        print(f"saved {cfg.out} checksum {save_pretrained(state, config, cfg.out):.6f}", flush=True)


if __name__ == "__main__":
    main()
