"""DeepSpeed's own checkpoints (tests/fixtures/deepspeed.tar.gz, written by DeepSpeed 0.19.8) loaded by
lightning_zero on gloo ranks, without DeepSpeed (tests/test_deepspeed_checkpoints.py).

Each fixture directory holds ``expected.pt``: the fp32 values and Adam moments DeepSpeed's own API reported
after the last step. A loaded engine must hold exactly those, and its next step must equal a plain torch
AdamW started from them (the step count and the LR schedule position restored too).
"""

from __future__ import annotations

import math
import sys
import tarfile
from pathlib import Path

import lightning.pytorch as pl
import torch

import lightning_zero
from lightning_zero.engine.state import full_optimizer_state

sys.path.insert(0, str(Path(__file__).parent))
import deepspeed_fixture_model as fm  # noqa: E402

ARCHIVE = Path(__file__).parent / "fixtures" / "deepspeed.tar.gz"


def extract(dest: Path) -> Path:
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(dest, filter="data")
    return dest


def engine_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith("ds_stage"))


def expected(path: Path) -> dict:
    return torch.load(path / "expected.pt", weights_only=False)


def config(stage: int, world: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "train_batch_size": 4 * world,
            "zero_optimization": {"stage": stage}, "optimizer": fm.OPTIMIZER, "scheduler": fm.SCHEDULER}


def _frozen(path: Path) -> bool:
    return path.name.endswith("_frozen")


def _ds_lr(step: int) -> float:
    """The lr DeepSpeed's WarmupLR (fm.SCHEDULER, log) gives optimizer step ``step`` (from 0)."""
    p = fm.SCHEDULER["params"]
    it = step - 1
    if it < 0:
        return p["warmup_min_lr"]
    return p["warmup_min_lr"] + (p["warmup_max_lr"] - p["warmup_min_lr"]) * math.log(it + 1) / math.log(
        p["warmup_num_steps"])


def reference_next_step(path: Path, world: int) -> dict[str, torch.Tensor]:
    """A plain model and torch AdamW from DeepSpeed's reported values, one step on every rank's batch."""
    exp = expected(path)
    model = fm.build(frozen=_frozen(path))
    model.load_state_dict({**exp["params"], **exp["buffers"], "head.weight": exp["params"]["emb.weight"]})
    o = fm.OPTIMIZER["params"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=_ds_lr(fm.STEPS), betas=tuple(o["betas"]), eps=o["eps"],
                            weight_decay=o["weight_decay"])
    names = {id(p): n for n, p in model.named_parameters()}
    for p in trainable:
        n = names[id(p)]
        opt.state[p] = {"step": torch.tensor(float(fm.STEPS)), "exp_avg": exp["exp_avg"][n].clone(),
                        "exp_avg_sq": exp["exp_avg_sq"][n].clone()}
    loss = sum(fm.loss_of(model, fm.STEPS, r, torch.device("cpu")) for r in range(world)) / world
    loss.backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def load_case(rank: int, world: int, root: str, stages: list[int]) -> dict:
    """Every fixture into our engine at every stage: what it holds after load and after one more step."""
    out = {}
    for path in engine_dirs(Path(root)):
        for stage in stages:
            model = fm.build(frozen=_frozen(path))
            engine, opt, _, sched = lightning_zero.initialize(
                model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                config=config(stage, world))
            loaded, client = engine.load_checkpoint(str(path))
            state = engine.full_state_dict(rank0_only=False)
            full_opt = full_optimizer_state(engine.zero, opt)
            names = full_opt["lightning_zero"]["param_names"]
            moments = {names[i]: {k: v for k, v in s.items()} for i, s in full_opt["state"].items()}
            record = {"loaded": Path(loaded).name, "client": client, "global_steps": engine.global_steps,
                      "lr": engine.get_lr()[0], "state": state, "moments": moments,
                      "iteration": sched.last_batch_iteration}
            engine.train()
            loss = fm.loss_of(engine, fm.STEPS, rank, engine.device)
            engine.backward(loss)
            engine.step()
            after = engine.full_state_dict(rank0_only=False)
            record["after"] = {k: v for k, v in after.items() if k in dict(model.named_parameters())}
            out[(path.name, stage)] = record
    return out


class FixtureModule(pl.LightningModule):
    """The LightningModule Lightning's DeepSpeedStrategy fixture trained (tests/fixtures/make_deepspeed_fixtures.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = fm.build()
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(int(batch[0]))
        return fm.loss_of(self.net, int(batch[0]), 0, self.device)

    def configure_optimizers(self):
        o = fm.OPTIMIZER["params"]
        return torch.optim.AdamW(self.parameters(), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                                 weight_decay=o["weight_decay"])


def trainer_resume_case(rank: int, world: int, ckpt: str, stage: int) -> dict:
    """Trainer.fit(ckpt_path=DeepSpeed's directory) under ZeroStrategy: one more step after the saved ones."""
    import warnings

    module = FixtureModule()
    data = torch.utils.data.DataLoader(range(fm.STEPS), batch_size=1)  # the fixture's: one epoch of STEPS batches
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=lightning_zero.ZeroStrategy(stage=stage),
                         max_steps=fm.STEPS + 1, max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data, ckpt_path=ckpt)
    state = trainer.strategy.full_state_dict(rank0_only=False)
    return {"global_step": trainer.global_step, "seen": module.seen, "state": state,
            "warnings": [str(w.message) for w in caught]}


def reference_lightning_next_step(path: Path, batch: int) -> dict[str, torch.Tensor]:
    """Lightning's DeepSpeedStrategy fixture: constant lr (no scheduler), one step on ``batch`` on one rank."""
    exp = expected(path)
    module = FixtureModule()
    module.load_state_dict({**exp["params"], **exp["buffers"], "net.head.weight": exp["params"]["net.emb.weight"]})
    opt = module.configure_optimizers()
    for n, p in module.named_parameters():
        opt.state[p] = {"step": torch.tensor(float(fm.STEPS)), "exp_avg": exp["exp_avg"][n].clone(),
                        "exp_avg_sq": exp["exp_avg_sq"][n].clone()}
    fm.loss_of(module.net, batch, 0, torch.device("cpu")).backward()
    opt.step()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
