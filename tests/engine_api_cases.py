"""lightning_zero.initialize against torch DDP on gloo ranks (tests/test_engine_api.py)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_zero


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 48), nn.GELU(), nn.Linear(48, 48), nn.GELU(), nn.Linear(48, 3))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(128, 12, generator=g), torch.randn(128, 3, generator=g))


def _config(zero: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "zero_optimization": dict(zero, reduce_bucket_size=500),
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 5,
                                                         "warmup_type": "linear"}}}


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).mean()


def ddp_reference(rank: int, world: int, micro_batches: int, device: str = "cpu") -> dict:
    model = DDP(_model().to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    # DeepSpeed's WarmupLR clock (lightning_zero/ds_schedules.py): optimizer step k runs with warm-up value k - 1
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, max(s - 1, 0) / 5))
    data = _data()
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, world, rank), drop_last=True)
    losses = []
    for i, (x, y) in enumerate(loader):
        if i == micro_batches:
            break
        x, y = x.to(device), y.to(device)
        boundary = (i + 1) % 2 == 0
        with (model.no_sync() if not boundary else torch.enable_grad()):
            loss = _loss(model(x), y)
            (loss / 2).backward()
        losses.append(float(loss))
        if boundary:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    return {"state": {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}, "losses": losses}


def engine_run(rank: int, world: int, zero: dict, micro_batches: int, save_at: int = -1, save_dir: str = "",
               resume: str = "") -> dict:
    model = _model()
    engine, opt, loader, sched = lightning_zero.initialize(model=model, model_parameters=model.parameters(),
                                                           config=_config(zero), training_data=_data())
    assert engine.train_batch_size() == 4 * 2 * world and engine.world_size == world and engine.global_rank == rank
    start = 0
    if resume:
        _, client = engine.load_checkpoint(resume)
        start = client["micro"]
    losses = []
    for i, (x, y) in enumerate(loader):
        if i < start:
            continue
        if i == micro_batches:
            break
        x, y = x.to(engine.device), y.to(engine.device)
        loss = _loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        if i + 1 == save_at:
            engine.save_checkpoint(save_dir, client_state={"micro": i + 1})
    state = {}
    for unit, full in engine.zero.gather_masters():
        for name, view in zip(unit.names, unit.param_views(full)):
            state[name] = view.detach().cpu().clone()
    return {"state": state, "losses": losses, "steps": engine.global_steps, "lr": opt.param_groups[0]["lr"]}


def batchnorm_buffers_case(rank: int, world: int, stage: int) -> dict:
    """BatchNorm under the engine API with accumulation 2 and an evaluation forward after every micro-batch,
    beside DDP (no_sync on a window's earlier micro-batches): each rank's running statistics and evaluation
    outputs, micro-batch by micro-batch."""
    import lightning_zero as deepspeed

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    accumulate = 2
    xs = [torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * i + rank)) for i in range(4)]
    ddp = DDP(model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model(), config={
        "train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": accumulate,
        "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    out = {"mean_err": [], "eval_err": []}
    for i, x in enumerate(xs):
        boundary = (i + 1) % accumulate == 0
        with ddp.no_sync() if not boundary else contextlib.nullcontext():
            (ddp(x).pow(2).mean() / accumulate).backward()
        if boundary:
            opt.step()
            opt.zero_grad()
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        ddp.eval()
        engine.eval()
        with torch.no_grad():
            out["eval_err"].append(float((ddp(x) - engine(x)).abs().max()))
        ddp.train()
        engine.train()
        out["mean_err"].append(float((ddp.module[1].running_mean - engine.module[1].running_mean).abs().max()))
    return out
