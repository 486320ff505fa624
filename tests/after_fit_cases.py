"""What the module is after ``fit`` under each stage (test_after_fit.py); each rank returns what it saw."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning_cases import TinyLM, lm_data

import lightning_zero
from lightning_zero import ZeroStrategy
from lightning_zero.engine.guard import ShardedStateDictError


def _trainer(stage: int, steps: int = 3, precision: str = "32-true", persistent: bool = False) -> pl.Trainer:
    """``persistent``: stage 3 keeps every unit gathered (the default threshold: small models, small groups)."""
    sharding = {} if persistent else dict(min_group_params=500, param_persistence_threshold=0)
    return pl.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=stage, reduce_bucket_size=500,
                                                                          **sharding),
                      precision=precision, max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=2)


def _plain_loss(state: dict) -> float:
    """The validation loss of an ordinary TinyLM holding ``state`` (no strategy)."""
    plain = TinyLM()
    plain.load_state_dict(state)
    # every batch has the same number of tokens: the mean over all 16 samples equals the mean of the
    # per-rank batch means that validate() reports
    everything = torch.cat([b for (b,) in lm_data(16)])
    with torch.no_grad():
        return float(plain._loss((everything,)))


class _GatherCounter(Callback):
    """All-gathered bytes when training ended (teardown follows, inside fit)."""

    def on_train_end(self, trainer, pl_module):
        self.at_train_end = trainer.strategy.comm.bytes_moved["all_gather"]


def _plain_logits(state: dict, idx: torch.Tensor) -> torch.Tensor:
    plain = TinyLM()
    plain.load_state_dict(state)
    with torch.no_grad():
        return plain(idx)


def after_fit_case(rank: int, world: int) -> dict:
    assert lightning_zero
    out = {}
    runs = [(s, p, False) for s in (1, 2, 3) for p in ("32-true", "bf16-mixed")] + [(3, "bf16-mixed", True)]
    for stage, precision, persistent in runs:
        pl.seed_everything(0, verbose=False)
        module = TinyLM()
        counter = _GatherCounter()
        trainer = _trainer(stage, precision=precision, persistent=persistent)
        trainer.callbacks.append(counter)
        trainer.fit(module, lm_data())
        comm = trainer.strategy.comm
        case = {"teardown_gathered": comm.bytes_moved["all_gather"] - counter.at_train_end}
        case["full"] = trainer.strategy.full_state_dict(rank0_only=False)
        try:
            case["module_state"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
        except ShardedStateDictError as err:
            case["state_dict_error"] = str(err)
        if stage == 3 and precision == "bf16-mixed":  # user code after fit: the fp32 model, as under DDP
            idx = torch.cat([b for (b,) in lm_data(4)])[:, :-1]
            with torch.no_grad():
                case["logits"] = module(idx)
            case["plain_logits"] = _plain_logits(case["full"], idx)
            case["param_dtypes"] = sorted({str(p.dtype) for p in module.parameters()})
        if stage == 3 and precision == "32-true":
            case["validate"] = trainer.validate(module, lm_data(16), verbose=False)[0]["val_loss"]
            case["plain_val"] = _plain_loss(case["full"])
            case["predicted"] = len(trainer.predict(module, lm_data(16)))
            case["still_sharded"] = all(p.numel() == 0 for p in module.fc1.parameters())
            # a new Trainer (another strategy object) given the module: the kept engine unshards it first
            fresh = _trainer(2, steps=5)
            fresh.fit(module, lm_data())
            case["refit_steps"] = fresh.global_step
            case["refit_state_ok"] = all(p.numel() > 0 for p in module.parameters())
        out[(stage, precision, "persistent") if persistent else (stage, precision)] = case
    return out
