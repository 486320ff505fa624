"""The engine's DeepSpeed methods, ``zero.Init`` and ``zero.GatheredParameters`` on gloo ranks
(tests/test_engine_methods.py). References are computed by hand or with a plain torch model."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

import lightning_zero
from lightning_zero import zero


class Net(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(10, width)
        self.norm = nn.LayerNorm(width)
        self.b = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.norm(self.a(x))))


def _config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
            "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}


def _batch(i: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * i + rank)
    return torch.randn(4, 10, generator=g), torch.randn(4, 4, generator=g)


def methods_case(rank: int, world: int, stage: int, tmp: str) -> dict:
    """On the GPU machine every rank's engine is on cuda:0 (the ranks share it over gloo)."""
    torch.manual_seed(0)
    model = Net()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    engine, optimizer, loader, sched = lightning_zero.initialize(model=model, model_parameters=model.parameters(),
                                                                 config=_config(stage, bf16={"enabled": False}))
    out: dict = {"is_module": isinstance(engine, nn.Module), "module_is_model": engine.module is model,
                 "loader": loader, "sched": sched, "device": str(engine.device), "local_rank": engine.local_rank,
                 "rank": engine.global_rank, "world": engine.world_size, "fp16": engine.fp16_enabled(),
                 "bf16": engine.bfloat16_enabled(), "stage": engine.zero_optimization_stage(),
                 "gas": engine.gradient_accumulation_steps(), "tbs": engine.train_batch_size(),
                 "mbs": engine.train_micro_batch_size_per_gpu(), "norm_before": engine.get_global_grad_norm(),
                 "partitions": (engine.zero_optimization_partition_gradients(),
                                engine.zero_optimization_partition_weights(), engine.zero_offload_optimizer(),
                                engine.zero_offload_param()),
                 "mom": engine.get_mom(), "training_dataloader": engine.training_dataloader,
                 "fp16_saver": engine.save_fp16_model == engine.save_16bit_model}
    out["names"] = [n for n, _ in engine.named_parameters()]
    out["n_params"] = len(list(engine.parameters()))
    engine.eval()
    out["eval_mode"] = (engine.training, model.training)
    engine.train()
    out["train_mode"] = (engine.training, model.training)
    # the reference: every rank's micro-batches, mean gradient, clipped to 0.5, SGD 0.1
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    boundaries, norms, ref_norms = [], [], []
    for step in range(2):
        for micro in range(2):
            i = 2 * step + micro
            boundaries.append(engine.is_gradient_accumulation_boundary())
            x, y = (t.to(engine.device) for t in _batch(i, rank))  # as a DeepSpeed script moves its batch
            loss = (engine(x) - y).pow(2).mean()
            returned = engine.backward(loss)
            out.setdefault("backward_returns_loss", returned is loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
        ref_opt.zero_grad()
        for micro in range(2):
            for r in range(world):
                x, y = _batch(2 * step + micro, r)
                ((reference(x) - y).pow(2).mean() / (2 * world)).backward()
        ref_norms.append(float(nn.utils.clip_grad_norm_(reference.parameters(), 0.5)))
        ref_opt.step()
    out.update(boundaries=boundaries, norms=norms, ref_norms=ref_norms, global_steps=engine.global_steps,
               skipped=engine.skipped_steps, lr=engine.get_lr())
    state = engine.full_state_dict()
    if rank == 0:
        out["max_err"] = max(float((state[k].cpu() - v).abs().max()) for k, v in reference.state_dict().items())
    # grads are gone after the step (DeepSpeed's step clears them); zero_grad is harmless
    engine.zero_grad()
    out["grads_after_step"] = [p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters()]
    # no_sync: a backward inside accumulates locally; the next boundary reduces the sum
    with engine.no_sync():
        x, y = (t.to(engine.device) for t in _batch(9, rank))
        engine.backward((engine(x) - y).pow(2).mean())
    out["no_sync_ok"] = True
    engine.zero_grad()
    # save_16bit_model: fp32 here, the module's keys; every rank calls it
    engine.save_16bit_model(tmp, "model16.bin")
    if rank == 0:
        saved = torch.load(Path(tmp) / "model16.bin")
        out["saved_16bit"] = sorted(saved) == sorted(reference.state_dict()) and all(
            torch.equal(saved[k].cpu(), state[k].cpu()) for k in saved)
    # load_checkpoint: no 'latest' -> (None, None) with a warning, as DeepSpeed; a missing tag is an error
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["no_latest"] = engine.load_checkpoint(str(Path(tmp) / "nothing_here"))
    out["no_latest_warned"] = any("latest" in str(w.message) for w in caught)
    try:
        engine.load_checkpoint(tmp, tag="no_such_tag")
        out["missing_tag"] = "no error"
    except FileNotFoundError as err:
        out["missing_tag"] = str(err)
    # save / load: custom tag, client state, load_module_only keeps the optimizer and counters
    engine.save_checkpoint(tmp, tag="mytag", client_state={"k": rank})
    out["latest"] = (Path(tmp) / "latest").read_text()
    path, client = engine.load_checkpoint(tmp)
    out["loaded"] = (Path(path).name, client)
    return out


def zero_init_case(rank: int, world: int, stage: int) -> dict:
    """A model built under zero.Init equals one built normally on the engine's device with the same seed (see
    [Note: initialization and seeds]: on a GPU the values come from the CUDA generator); no rank holds it whole."""
    torch.manual_seed(0)
    with zero.Init():
        lazy = Net(2048)
    out = {"meta": all(p.is_meta for p in lazy.parameters())}
    try:
        with zero.GatheredParameters(list(lazy.parameters())):
            pass
        out["meta_gather"] = "no error"
    except RuntimeError as err:
        out["meta_gather"] = str(err)
    engine, _, _, _ = lightning_zero.initialize(model=lazy, config=_config(stage))
    torch.manual_seed(0)
    with torch.device(engine.device):
        normal = Net(2048).cpu()
    state = engine.full_state_dict(rank0_only=False)
    out["max_err"] = max(float((state[k].cpu() - v).abs().max()) for k, v in normal.state_dict().items())
    out["held"] = sum(u.master.numel() for u in engine.zero.units)
    out["total"] = sum(p.numel() for p in normal.parameters())
    out["meta_left"] = any(p.is_meta for p in lazy.parameters())
    return out


def gathered_case(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    engine, _, _, _ = lightning_zero.initialize(model=model, config=_config(stage))
    full = engine.full_state_dict(rank0_only=False)
    out = {}
    with zero.GatheredParameters([model.a.weight, model.b.bias]):
        out["read"] = bool(torch.equal(model.a.weight.detach().cpu(), full["a.weight"].cpu())) and tuple(
            model.a.weight.shape) == (32, 10)
        model.b.bias.data.fill_(123.0)  # no modifier_rank: discarded
    out["discarded"] = bool(torch.equal(engine.full_state_dict(rank0_only=False)["b.bias"], full["b.bias"]))
    with zero.GatheredParameters(model.b.bias, modifier_rank=0):
        if rank == 0:
            model.b.bias.data.fill_(7.0)  # only rank 0's change counts; other ranks' are overwritten
        else:
            model.b.bias.data.fill_(-1.0)
    after = engine.full_state_dict(rank0_only=False)
    out["modified"] = bool(torch.all(after["b.bias"] == 7.0)) and bool(torch.equal(after["a.weight"], full["a.weight"]))
    # the next forward computes with the new values (stage 3 gathers from the shards)
    engine.eval()
    with torch.no_grad():
        x = torch.zeros(2, 10)
        y = engine(x.to(engine.device)).cpu()
    reference = Net()
    reference.load_state_dict(after)
    out["forward_err"] = float((y - reference(x)).abs().max())
    out["shape_outside"] = tuple(model.b.bias.shape)
    return out


def full_values_case(rank: int, world: int, stage: int, offload: bool) -> dict:
    """deepspeed.utils.safe_get_full_* against a plain AdamW model fed every rank's batch."""
    from lightning_zero import utils as ds_utils

    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    zero_section = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": zero_section,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}}
    engine, _, _, _ = lightning_zero.initialize(model=model, model_parameters=model.parameters(), config=config)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.0)
    errors = {"grad": 0.0, "param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0, "local": 0.0}
    shapes_ok, set_ok = True, False
    for i in range(2):
        x, y = (t.to(engine.device) for t in _batch(i, rank))
        engine.backward((engine(x) - y).pow(2).mean())
        ref_opt.zero_grad()
        for r in range(world):
            rx, ry = _batch(i, r)
            ((reference(rx) - ry).pow(2).mean() / world).backward()
        for p, ref in zip(model.parameters(), reference.parameters()):
            grad = ds_utils.safe_get_full_grad(p)
            shapes_ok &= grad.shape == ref.shape
            errors["grad"] = max(errors["grad"], (grad.cpu() - ref.grad).abs().max().item())
            local = ds_utils.safe_get_local_grad(p)
            if local is not None:  # this rank's piece is a contiguous part of the flattened full gradient
                flat = ref.grad.reshape(-1)
                starts = [k for k in range(flat.numel() - local.numel() + 1)
                          if torch.allclose(flat[k:k + local.numel()], local.cpu(), atol=1e-6)]
                errors["local"] = max(errors["local"], 0.0 if starts else 1.0)
        engine.step()
        ref_opt.step()
    for p, ref in zip(model.parameters(), reference.parameters()):
        errors["param"] = max(errors["param"], (ds_utils.safe_get_full_fp32_param(p).cpu() - ref).abs().max().item())
        for key in ("exp_avg", "exp_avg_sq"):
            value = ds_utils.safe_get_full_optimizer_state(p, key).cpu()
            errors[key] = max(errors[key], (value - ref_opt.state[ref][key]).abs().max().item())
    first = next(model.parameters())
    ds_utils.safe_set_full_fp32_param(first, torch.full_like(ds_utils.safe_get_full_fp32_param(first), 0.25))
    set_ok = bool((ds_utils.safe_get_full_fp32_param(first) == 0.25).all())
    return {"errors": errors, "shapes_ok": shapes_ok, "set_ok": set_ok,
            "no_grad_after_step": ds_utils.safe_get_full_grad(first) is None}


class CheckpointedNet(Net):
    """Net whose middle runs under deepspeed.checkpointing.checkpoint (as Megatron-style scripts call it)."""

    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def middle(h: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.norm(self.a(h)))
        h = lightning_zero.checkpointing.checkpoint(middle, x) if self.recompute else middle(x)
        return self.b(h)


def checkpointing_case(rank: int, world: int, stage: int) -> dict:
    """The same training with and without recomputation (stage 3 gathers inside the recomputed region)."""
    finals = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = CheckpointedNet(recompute)
        config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
        engine, _, _, _ = lightning_zero.initialize(model=model, model_parameters=model.parameters(), config=config)
        for i in range(3):
            x, y = (t.to(engine.device) for t in _batch(i, rank))
            engine.backward((engine(x) - y).pow(2).mean())
            engine.step()
        finals.append({k: v.cpu() for k, v in engine.full_state_dict(rank0_only=False).items()})
    return {"max_diff": max((finals[0][k] - finals[1][k]).abs().max().item() for k in finals[0])}
