"""Offload cases for ``tests/test_offload.py``: each rank returns what it saw."""

from __future__ import annotations

import resource
import threading
import time

import lightning.pytorch as pl
import torch
from checkpoint_cases import FIRST, TOTAL, fit_steps
from lightning_cases import fit_case
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import ZeroConfig, ZeroStrategy

LM = dict(accumulate=2, clip_val=0.5)
SMALL_UNITS = dict(min_group_params=10, param_persistence_threshold=0)
HOST_ACC = dict(offload_accumulation="host")
PER_MODULE = dict(SMALL_UNITS, wrap_modules=("Embedding", "Linear", "LayerNorm"))  # a unit each: a share can move


def nvme(path: str, **more) -> dict:
    # 32 KiB of staging (three slots of ~2.7k elements): zero2's units stream in several chunks a step;
    # stage 3's largest group needs a larger slot
    budget = 96 * 1024 if "offload_params" in more else 32 * 1024
    return dict(offload_optimizer="nvme", nvme_path=path, nvme_buffer_bytes=budget, **more)


def parity_cases(nvme_dir: str) -> dict:
    cpu = dict(offload_optimizer="cpu")
    return {
        "ddp": (("lm", "ddp"), LM),
        "zero1_cpu": (("lm", "zero1"), dict(LM, options=cpu)),
        "zero2_cpu": (("lm", "zero2"), dict(LM, options=cpu)),
        "zero2_half": (("lm", "zero2"), dict(LM, options=dict(cpu, offload_fraction=0.5))),
        "zero3_cpu": (("lm", "zero3"), dict(LM, options=dict(cpu, offload_params="cpu", **SMALL_UNITS))),
        "zero3_opt_third": (("lm", "zero3"), dict(LM, options=dict(cpu, offload_fraction=0.3, **PER_MODULE))),
        "zero2_nvme": (("lm", "zero2"), dict(LM, options=nvme(nvme_dir))),
        "zero3_nvme": (("lm", "zero3"), dict(LM, options=nvme(nvme_dir, offload_params="nvme", **SMALL_UNITS))),
        "zero3_nvme_cpu": (("lm", "zero3"), dict(LM, options=nvme(nvme_dir, offload_params="cpu", **SMALL_UNITS))),
        # micro-batch gradients added on the host instead of a device accumulator
        "zero2_host_acc": (("lm", "zero2"), dict(LM, options=dict(cpu, offload_fraction=0.5, **HOST_ACC))),
        "zero3_host_acc": (("lm", "zero3"), dict(LM, options=dict(cpu, offload_params="cpu", **HOST_ACC,
                                                                  **SMALL_UNITS))),
        "zero2_nvme_host_acc": (("lm", "zero2"), dict(LM, options=nvme(nvme_dir, **HOST_ACC))),
        # part of the units offloaded, their gathers copying the fp32 host master (zero_auto's largest models)
        "zero3_half_params_cpu_host_acc": (("lm", "zero3"), dict(LM, options=dict(
            cpu, offload_fraction=0.5, offload_params="cpu", **HOST_ACC, **PER_MODULE))),
        "gan_ddp": (("gan", "ddp_find_unused_parameters_true"), {}),
        "gan_zero2_cpu": (("gan", "zero2"), dict(options=dict(cpu, offload_fraction=0.6))),
        "gan_zero2_nvme": (("gan", "zero2"), dict(options=nvme(nvme_dir))),
        "zero2_bf16": (("lm", "zero2"), dict(LM, precision="bf16-mixed")),
        "zero2_bf16_cpu": (("lm", "zero2"), dict(LM, precision="bf16-mixed", options=cpu)),
        "zero3_bf16": (("lm", "zero3"), dict(LM, precision="bf16-mixed", options=SMALL_UNITS)),
        "zero3_bf16_nvme": (("lm", "zero3"), dict(LM, precision="bf16-mixed",
                                                   options=nvme(nvme_dir, offload_params="nvme", **SMALL_UNITS))),
        "auto": (("lm", "zero_auto"), LM),
        # no clipping, no hook before the step: the host steps units while backward runs
        "ddp_noclip": (("lm", "ddp"), dict(accumulate=2, probe=False)),
        "zero2_overlap": (("lm", "zero2"), dict(accumulate=2, probe=False, options=cpu)),
        "zero2_overlap_half": (("lm", "zero2"), dict(accumulate=2, probe=False, options=dict(cpu, offload_fraction=0.5))),
        "zero3_overlap": (("lm", "zero3"), dict(accumulate=2, probe=False,
                                                options=dict(cpu, offload_params="cpu", **SMALL_UNITS))),
        "zero2_no_overlap": (("lm", "zero2"), dict(accumulate=2, probe=False, options=dict(cpu, overlap_step=False))),
        "zero2_overlap_host_acc": (("lm", "zero2"), dict(accumulate=2, probe=False, options=dict(cpu, **HOST_ACC))),
        "fp16": (("lm", "zero2"), dict(plugin="16-mixed", inject=(2, 3), options=dict(initial_scale_power=8))),
        "fp16_cpu": (("lm", "zero2"), dict(plugin="16-mixed", inject=(2, 3),
                                           options=dict(cpu, initial_scale_power=8, offload_fraction=0.5))),
    }


def run_parity(rank: int, world: int, nvme_dir: str) -> dict:
    cases = parity_cases(nvme_dir)
    out = {name: fit_case(rank, world, *args, **kwargs) for name, (args, kwargs) in cases.items()}
    # the overlap worker handed units while backward still runs, as with a large model on a GPU (here the units
    # are far below HOST_STEP_CHUNK, so without this every batch would wait for the drain at the step)
    from lightning_zero.engine import overlap

    chunk, overlap.HOST_STEP_CHUNK = overlap.HOST_STEP_CHUNK, 64
    try:
        for name in ("zero2_overlap", "zero3_overlap"):
            args, kwargs = cases[name]
            out[name + "_small_chunks"] = fit_case(rank, world, *args, **kwargs)
    finally:
        overlap.HOST_STEP_CHUNK = chunk
    return out


def slow_publish_case(rank: int, world: int) -> dict:
    """Stage 3 offload, bf16, host step during backward, LoRA blocks: a block's adapters get their gradients before
    the block's backward ends, so the worker publishes a unit's new values into its full buffer while the main thread
    may release that buffer. The publish is slowed down so that the release lands inside it. Returns the fit with and
    without the slowdown, and how many releases of the very buffer being written came during a publish."""
    from parity_matrix import Cell, fit_cell

    from lightning_zero.engine import flat_unit

    cell = Cell("lora", "zero3_offload", "bf16-mixed", accumulate=1, clip=False, world=world)
    plain_copy, plain_release = flat_unit._to_device, flat_unit.FlatUnit.release_full
    publishing = {"storage": None}  # the storage the worker is writing into, while it does
    crossed = [0]

    def slow_copy(dst, src):
        if not threading.current_thread().name.startswith("lz-host-step"):
            return plain_copy(dst, src)
        publishing["storage"] = dst.untyped_storage().data_ptr()
        time.sleep(0.02)
        plain_copy(dst, src)
        publishing["storage"] = None

    def counted_release(unit):
        mine = unit.full.untyped_storage().data_ptr() if unit.storage_alive else None
        if mine is not None and not torch.is_grad_enabled() and any(p.requires_grad for p in unit.params):
            deadline = time.monotonic() + 0.5  # in backward, a unit with adapters: give its publish time to begin
            while publishing["storage"] != mine and time.monotonic() < deadline:
                time.sleep(0.001)
        crossed[0] += mine is not None and publishing["storage"] == mine
        plain_release(unit)

    try:
        reference = fit_cell(cell, world)
        flat_unit._to_device, flat_unit.FlatUnit.release_full = slow_copy, counted_release
        slowed = fit_cell(cell, world)
    finally:
        flat_unit._to_device, flat_unit.FlatUnit.release_full = plain_copy, plain_release
    return {"reference": reference, "slowed": slowed, "crossed": crossed[0]}


def run_checkpoints(rank: int, world: int, d: str, nvme_dir: str) -> dict:
    """Offloaded state saved and restored through sharded checkpoints, to and from plain stages."""
    cpu = dict(options=dict(offload_optimizer="cpu", offload_fraction=0.5))
    z3 = dict(options=nvme(nvme_dir, offload_params="nvme"))
    return {
        "ref": fit_steps(world, "zero2", TOTAL),
        "cpu_a": fit_steps(world, "zero2", FIRST, save_to=f"{d}/cpu.ckpt", **cpu),
        "plain_from_cpu": fit_steps(world, "zero2", TOTAL, ckpt_in=f"{d}/cpu.ckpt"),
        "nvme_a": fit_steps(world, "zero3", FIRST, save_to=f"{d}/nvme.ckpt", **z3),
        "nvme_from_nvme": fit_steps(world, "zero3", TOTAL, ckpt_in=f"{d}/nvme.ckpt", **z3),
        "cpu_from_nvme": fit_steps(world, "zero2", TOTAL, ckpt_in=f"{d}/nvme.ckpt", **cpu),
        "plain_a": fit_steps(world, "zero1", FIRST, save_to=f"{d}/plain.ckpt"),
        "nvme_from_plain": fit_steps(world, "zero3", TOTAL, ckpt_in=f"{d}/plain.ckpt", **z3),
    }


class Wide(pl.LightningModule):
    """Parameters dominate memory: ``layers`` square layers of width 512 (no activations to speak of)."""

    def __init__(self, layers: int, dim: int = 512) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])

    def training_step(self, batch, batch_idx):
        return self.layers(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class _PeakRss:
    """Samples this process's RSS (it also reads ru_maxrss, which is a lifetime peak)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with open("/proc/self/statm") as f:
                self.peak = max(self.peak, int(f.read().split()[1]) * resource.getpagesize())
            time.sleep(0.002)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def rss_case(rank: int, world: int, layers: int, options: dict) -> dict:
    """Peak RSS growth over a fit of ``Wide(layers)`` under zero2 (one layer a unit) with ``options``."""
    assert lightning_zero
    pl.seed_everything(0, verbose=False)
    module = Wide(layers)
    data = DataLoader(TensorDataset(torch.randn(8, 512)), batch_size=2)
    config = ZeroConfig(stage=2, reduce_bucket_size=512 * 512, **options)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=ZeroStrategy(config=config),
                         max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * resource.getpagesize()
    with _PeakRss() as rss:
        trainer.fit(module, data)
    return {"growth": rss.peak - before, "numel": sum(p.numel() for p in module.parameters())}


class _Measure(pl.Callback):
    """At the second step: the live storages, split into the offloaded units' host side (their arenas and the
    optimizer state of their pieces) and the rest, beside the strategy's planned figures."""

    def __init__(self) -> None:
        self.seen: dict = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step != 1:
            return
        from storage_probe import live_storages, split_host

        engine = trainer.strategy.engine
        storages = live_storages(p.grad for p in pl_module.parameters())
        host: list[torch.Tensor] = []
        files: list[torch.Tensor] = []  # NVMe: tensors mapped from files (their pages are the disk's)
        off = engine.offloader
        if off is not None:
            host.append(off.grads.flat)
            if off.store is not None:
                files += [f.tensor for f in off.store.files.values()]
                host.append(off.store.staging.flat)
            else:
                host.append(off.backend.arena.flat)
            pieces = {id(q) for u in off.units for q in u.pieces if q is not None}
            state = [t for k, v in optimizer.state.items() if id(k) in pieces for t in v.values()
                     if isinstance(t, torch.Tensor) and t.dim() > 0]
            (files if off.store is not None and off.store.masters else host).extend(state)
        file_bytes, rest = split_host(storages, files)
        host_bytes, device_bytes = split_host({p: n for p, n in storages.items() if p not in
                                               {t.untyped_storage().data_ptr() for t in files}}, host)
        report = trainer.strategy.memory_report().as_dict()
        staging = engine.config.nvme_buffer_bytes if engine.config.offload_optimizer == "nvme" else 0
        self.seen = {"host": host_bytes, "device": device_bytes, "files": file_bytes, "num_params": report["num_params"],
                     "planned_device": report["planned_device_bytes"],
                     "planned_host": report["planned_host_bytes"] + staging, "planned_nvme": report["planned_nvme_bytes"]}


def planner_case(rank: int, world: int, runs: dict) -> dict:
    """What lightning_zero.estimate plans for ``Wide(16)`` under each config, beside the storages really alive."""
    assert lightning_zero
    out = {}
    for name, options in runs.items():
        pl.seed_everything(0, verbose=False)
        module = Wide(16)
        data = DataLoader(TensorDataset(torch.randn(16, 512)), batch_size=2)
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=ZeroStrategy(config=ZeroConfig(**options)),
                             precision="bf16-mixed", max_steps=3, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[probe := _Measure()])
        trainer.fit(module, data)
        out[name] = probe.seen
    return out


class OneUlpEdit(pl.LightningModule):
    """lr 0: only the user's edits move the weights. After step 2 one element moves by one unit in the last place,
    after step 3 a whole row is negated. Without the check before each forward, the next step would publish the
    unedited master over both."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.expected: torch.Tensor | None = None

    def training_step(self, batch, _):
        return self.net(batch[0]).pow(2).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        weight = self.net[0].weight
        with torch.no_grad():
            if batch_idx == 1:
                weight.data.view(-1)[37] = torch.nextafter(weight.data.view(-1)[37], torch.tensor(9.0))
            if batch_idx == 2:
                weight.data[3].neg_()
        if batch_idx in (1, 2):
            self.expected = weight.detach().float().cpu().clone()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def edit_case(rank: int, world: int) -> dict:
    pl.seed_everything(0, verbose=False)
    module = OneUlpEdit()
    data = DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=world, max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         strategy=ZeroStrategy(config=ZeroConfig(stage=2, offload_optimizer="cpu")))
    trainer.fit(module, data)
    return {"expected": module.expected, "final": trainer.strategy.full_state_dict(rank0_only=False)["net.0.weight"]}


class EditBeforeForward(pl.LightningModule):
    """A WGAN critic clamping its weights in training_step, before its forward (or in on_before_zero_grad, which runs
    between that forward and backward): under offload the host steps the master during the backward that follows."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.losses: list[float] = []

    def _clamp(self) -> None:
        for p in self.net.parameters():
            p.data.clamp_(-0.15, 0.15)

    def training_step(self, batch, _):
        if self.where == "training_step":
            self._clamp()
        loss = self.net(batch[0]).pow(2).mean()
        self.losses.append(float(loss))
        return loss

    def on_before_zero_grad(self, optimizer):
        if self.where == "on_before_zero_grad":
            self._clamp()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def edit_before_forward_case(rank: int, world: int, strategy: str, where: str) -> dict:
    pl.seed_everything(0, verbose=False)
    module = EditBeforeForward(where)
    data = DataLoader(TensorDataset(torch.randn(48, 8)), batch_size=4)
    chosen = ZeroStrategy(config=ZeroConfig(stage=2, offload_optimizer="cpu")) if strategy == "zero2_offload" else strategy
    trainer = pl.Trainer(accelerator="cpu", devices=world, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, strategy=chosen)
    trainer.fit(module, data)
    state = (trainer.strategy.full_state_dict(rank0_only=False) if strategy != "ddp" else module.state_dict())
    engine = getattr(trainer.strategy, "_parked", None) or getattr(trainer.strategy, "engine", None)
    return {"losses": module.losses, "state": {k: v.float().clone() for k, v in state.items()},
            "stepped_in_backward": engine.offloader.stepped_in_backward if engine is not None else 0}
