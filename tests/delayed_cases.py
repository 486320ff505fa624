"""The delayed host step (``tests/test_delayed_step.py``): a Lightning fit on two ranks, and the same
training written out in plain PyTorch with ZeRO-Offload's one-step-stale update."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import lightning_zero
from lightning_zero import ZeroStrategy

N, DIM, BATCH, LR = 64, 12, 4, 0.05


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, DIM, generator=g)
    return TensorDataset(x, (x @ torch.randn(DIM, 1, generator=g)).tanh() + 0.1 * torch.randn(N, 1, generator=g))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


class TiedNet(nn.Module):
    """``w`` is used inside a reentrant checkpoint and again outside it: its gradient comes twice in one backward
    (the second one late, after its unit was reduced)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.w, self.out = nn.Linear(DIM, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.w(t)), self.inp(x), use_reentrant=True)
        return self.out(self.w(h))


class ReadStateAt(pl.Callback):
    """Reads the full state after the given step, as a checkpoint would (the running update must be waited for)."""

    def __init__(self, step: int) -> None:
        self.step, self.state = step, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.state = {k: v.clone() for k, v in trainer.strategy.full_state_dict(rank0_only=False).items()}


class Regression(pl.LightningModule):
    def __init__(self, warmup: bool, make=net) -> None:
        super().__init__()
        self.net = make()
        self.warmup = warmup
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)
        if not self.warmup:
            return opt
        # the learning rate changes every step: the delayed update must use the rate of its own step
        return [opt], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4)),
                        "interval": "step"}]


def fit(rank: int, world: int, delayed: bool, warmup: bool = True, stage: int = 2, fraction: float = 1.0,
        clip: float = 0.0, make=net, one_gpu: bool = False, **options) -> dict:
    """``one_gpu``: every rank on cuda:0, over gloo (see dist_utils.run_ranks): the upload stream and events for real."""
    assert lightning_zero
    pl.seed_everything(0, verbose=False)
    module = Regression(warmup, make)
    strategy = ZeroStrategy(stage=stage, offload_optimizer="cpu", offload_fraction=fraction, delayed_step=delayed,
                            min_group_params=10, param_persistence_threshold=0,
                            process_group_backend="gloo" if one_gpu else None, **options)
    reader = ReadStateAt(3)
    where = dict(accelerator="gpu", devices=1, num_nodes=world) if one_gpu else dict(accelerator="cpu", devices=world)
    trainer = pl.Trainer(**where, strategy=strategy, max_epochs=1, logger=False,
                         callbacks=[reader],
                         gradient_clip_val=clip or None, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    trainer.fit(module, DataLoader(Subset(data(), range(rank, N, world)), batch_size=BATCH))  # rank r: r, r+w, ...
    engine = trainer.strategy.engine or trainer.strategy._parked
    offloader = engine.offloader if engine is not None else None
    state = {k: v.detach().cpu().clone() for k, v in trainer.strategy.full_state_dict(rank0_only=False).items()}
    stale = sorted(n.removeprefix("net.") for u in offloader.units for n in u.names) if offloader is not None else []
    return {"losses": module.losses, "state": state, "steps": trainer.global_step, "stale": stale,
            "state_at_3": reader.state,
            "launched": offloader.delayed.launched if offloader is not None and offloader.delayed else 0,
            "units": len(offloader.units) if offloader is not None else 0,
            "early": offloader._early.count if offloader is not None and offloader._early else 0,
            "never_early": sorted(offloader._early.never) if offloader is not None and offloader._early else []}


def stale_reference(world: int, warmup: bool = True, clip: float = 0.0, stale: list[str] | None = None,
                    make=net, exact_steps: int = 1) -> dict:
    """The same training in plain PyTorch: from the second step on, each update of the ``stale`` parameters
    (None: all) reaches the values forward uses one step late (ZeRO-Offload's delayed parameter update), the
    others' at once; rank r's k-th batch is what ``fit`` gives it, their mean loss the global batch's."""
    names = [n for n, _ in make().named_parameters()]
    late = [stale is None or n in stale for n in names]
    model = make()
    master = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4)) if warmup else None
    x, y = data().tensors
    steps = N // (BATCH * world)
    device_values = [p.detach().clone() for p in master]  # what forward uses
    pending = False
    after: list[dict] = []
    for k in range(steps):
        idx = torch.tensor([r + world * (BATCH * k + j) for r in range(world) for j in range(BATCH)])
        for p, v in zip(model.parameters(), device_values):
            p.data.copy_(v)
        model.zero_grad()
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if pending:  # the previous update is published before this one starts
            device_values = [p.detach().clone() for p in master]
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.clone()
        opt.step()
        if sched is not None:
            sched.step()
        if k < exact_steps:  # the first update creates the optimizer state: it runs at once (and delayed_step_warmup)
            device_values = [p.detach().clone() for p in master]
        else:
            pending = True
            device_values = [v if is_late else m.detach().clone() for v, m, is_late in zip(device_values, master, late)]
        after.append({n: m.detach().clone() for n, m in zip(names, master)})
    return {"state": after[-1], "after": after}


def run_delayed(rank: int, world: int, one_gpu: bool = False) -> dict:
    if one_gpu:  # fp32 matmuls as on the host, so that the GPU follows the rule computed there
        torch.backends.cuda.matmul.allow_tf32 = False
    out = {"delayed": fit(rank, world, True, one_gpu=one_gpu), "exact": fit(rank, world, False, one_gpu=one_gpu),
           "delayed_z3_clip": fit(rank, world, True, stage=3, clip=0.5, one_gpu=one_gpu),
           "delayed_z2_half": fit(rank, world, True, fraction=0.5, reduce_bucket_size=400, one_gpu=one_gpu),  # several units
           "delayed_tied": fit(rank, world, True, make=TiedNet, reduce_bucket_size=100, one_gpu=one_gpu),
           "delayed_after3": fit(rank, world, True, delayed_step_warmup=3, one_gpu=one_gpu)}
    if rank == 0:
        out["reference_after3"] = stale_reference(world, exact_steps=3)
        out["reference_tied"] = stale_reference(world, make=TiedNet)
        out["reference"] = stale_reference(world)
        out["reference_clip"] = stale_reference(world, clip=0.5)
        out["reference_half"] = stale_reference(world, stale=out["delayed_z2_half"]["stale"])
    return out


def finetune_delayed(rank: int, world: int, ckpt: str) -> dict:
    """BackboneFinetuning under delayed_step: the backbone's group arrives at epoch 1 with no optimizer state
    (that step runs at once on every rank), then a checkpoint after epoch 2 and a resumed third epoch."""
    from finetune_cases import FinetuneLM, UnfreezeOnResume
    from model_zoo import zoo_data

    def trainer(epochs: int) -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", devices=world, max_epochs=epochs, logger=False,
                          strategy=ZeroStrategy(stage=2, offload_optimizer="cpu", delayed_step=True, reduce_bucket_size=300),
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          num_sanity_val_steps=0, callbacks=[UnfreezeOnResume(unfreeze_backbone_at_epoch=1)])

    pl.seed_everything(0, verbose=False)
    first, t1 = FinetuneLM(False), trainer(2)
    t1.fit(first, zoo_data())
    t1.save_checkpoint(ckpt)
    launched = t1.strategy._parked.offloader.delayed.launched
    pl.seed_everything(0, verbose=False)
    resumed, t2 = FinetuneLM(False), trainer(3)
    t2.fit(resumed, zoo_data(), ckpt_path=ckpt)
    state = {k: v.detach().cpu().clone() for k, v in t2.strategy.full_state_dict(rank0_only=False).items()}
    return {"steps": (t1.global_step, t2.global_step), "launched": launched, "groups": len(t2.optimizers[0].param_groups),
            "losses": first.losses + resumed.losses, "state": state}


def early_vs_at_step(rank: int, world: int, one_gpu: bool = False) -> dict:
    """Zoo models under delayed_step, each twice: as it runs, and with the early publish switched off (every update
    published at the step, as before it existed). Values reaching the device sooner must change nothing.
    ``one_gpu``: both ranks on cuda:0 (gloo), deterministic kernels, so that the two runs can be equal bit for bit."""
    from model_zoo import fit_zoo

    if one_gpu:
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)

    from lightning_zero.engine import delayed as delayed_module

    delayed = dict(offload_optimizer="cpu", delayed_step=True)
    cases = {
        "plain_z2_accumulate": (("plain", "zero2"), dict(accumulate=2, options=delayed)),
        "moe_z3_checkpointing": (("moe", "zero3"), dict(options=dict(delayed, activation_checkpointing=("Block",)))),
        "unused_z2_half_host": (("unused", "zero2"), dict(accumulate=2, options=dict(
            delayed, offload_fraction=0.5, offload_accumulation="host"))),
        "lora_z3_bf16": (("lora", "zero3"), dict(precision="bf16-mixed", options=delayed)),
    }
    cls = delayed_module.EarlyPublish
    publish, backward_done = cls._publish, cls.backward_done
    counted = [0]

    def counting(self, unit):
        counted[0] += 1
        publish(self, unit)

    out = {}
    for name, (args, kwargs) in cases.items():
        counted[0] = 0
        cls._publish = counting
        try:
            out[name] = fit_zoo(rank, world, *args, epochs=3, one_gpu=one_gpu, **kwargs)
        finally:
            cls._publish = publish
        out[name]["early"] = counted[0]
        cls.backward_done = lambda self, unit: None
        try:
            out[name + "@step"] = fit_zoo(rank, world, *args, epochs=3, one_gpu=one_gpu, **kwargs)
        finally:
            cls.backward_done = backward_done
    return out
