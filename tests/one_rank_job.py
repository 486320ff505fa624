"""A 2-rank job in which something happens on one rank only, started the way users start one
(``python script.py`` with ``Trainer(devices=2)``: Lightning launches rank 1 itself).

    python tests/one_rank_job.py OUT {overflow|sharded|collective|save} STRATEGY

- ``overflow``: fp16 with loss scaling; rank 1's loss is infinite at steps 2 and 3. After every
  step every rank builds ``trainer.strategy.lightning_module_state_dict()`` (DTensors; under fp16
  a collective), then a callback on rank 0 only reads state (the DTensors' local values and
  elementwise math on them, the loss scale, the memory report). Each rank records which steps
  changed its parameters; the job must end normally.
- ``sharded``: rank 0 alone calls ``lightning_module_state_dict()``, a collective under fp16: rank 0
  must get an error naming it, and every rank must end, not hang.
- ``collective``: a callback on rank 0 only calls ``trainer.strategy.full_state_dict()``, a
  collective: rank 0 must get an error naming the rank that never came, not hang.
- ``save``: rank 0 alone calls ``trainer.save_checkpoint``: the error names that call, not the strategy's
  internals it goes through.

Every rank writes ``rank{r}.pid`` when it starts and ``rank{r}.pt`` when it ends normally.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from parity_zoo import TinyGPT, lm_loss, token_data  # noqa: E402

import lightning_zero  # noqa: E402
from lightning_zero import ZeroConfig, ZeroPrecision, ZeroStrategy  # noqa: E402

OVERFLOW_AT = (2, 3)


class InfOnRankOne(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyGPT()
        self.trace: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        loss = lm_loss(self.model(idx[:, :-1]), idx)
        if self.global_rank == 1 and self.global_step in OVERFLOW_AT:
            loss = loss * math.inf
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        engine = self.trainer.strategy.engine
        self.trace.append(torch.cat([p.detach().float().reshape(-1) for u in engine.units for p in u.pieces
                                     if p is not None]).clone())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class ReadOnRankZero(pl.Callback):
    """What a user's logging or snapshot callback does under ``if trainer.is_global_zero``."""

    def __init__(self, scenario: str) -> None:
        self.scenario = scenario
        self.reads = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from torch.distributed.tensor import DTensor

        state = trainer.strategy.lightning_module_state_dict() if self.scenario == "overflow" else None
        if not trainer.is_global_zero:
            return
        if self.scenario == "collective":
            trainer.strategy.full_state_dict()  # a collective under is_global_zero: an error, not a hang
        if self.scenario == "sharded":
            trainer.strategy.lightning_module_state_dict()  # the same: an error on rank 0, not a hang
        if self.scenario == "save":
            trainer.save_checkpoint(f"{trainer.default_root_dir}/one_rank.ckpt")  # named as the user called it
        parts = [(v.float() * 2).to_local() for v in state.values() if isinstance(v, DTensor)]
        assert parts and all(torch.isfinite(t).all() for t in parts)
        assert trainer.precision_plugin.loss_scale > 0
        trainer.strategy.memory_report()
        self.reads += 1


def make_strategy(name: str) -> ZeroStrategy:
    stage = int(name[4])
    options = dict(stage=stage, reduce_bucket_size=1500, initial_scale_power=8, hysteresis=1,
                   rendezvous_timeout_s=10.0)
    if stage == 3:
        options.update(min_group_params=500, param_persistence_threshold=0)
    if name.endswith("offload"):
        options.update(offload_optimizer="cpu", offload_params="cpu" if stage == 3 else "none")
    return ZeroStrategy(config=ZeroConfig(**options))


def main(out: Path, scenario: str, strategy: str) -> None:
    assert lightning_zero
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    pl.seed_everything(0, verbose=False)
    module = InfOnRankOne()
    reader = ReadOnRankZero(scenario)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=make_strategy(strategy),
                         plugins=[ZeroPrecision("16-mixed")], max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[reader])
    trainer.fit(module, token_data())
    changed = [not torch.equal(a, b) for a, b in zip(module.trace[1:], module.trace[:-1])]
    torch.save({"changed": changed, "scale": trainer.precision_plugin.loss_scale, "reads": reader.reads,
                "steps": trainer.global_step}, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
