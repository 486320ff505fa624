"""ZeroStrategy as Lightning sees it: registration, input errors, fp16 plugin, state dict, memory report, metrics.

devices=1 cases run in this process (the strategy starts a one-rank gloo group here and later
Trainers reuse it); the world-2 cases share one spawn (``world2`` fixture).
"""

from __future__ import annotations

import importlib
import math

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from dist_utils import full_state, run_ranks
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import StrategyRegistry
from lightning_cases import TinyLM, lm_data
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import (
    LossScaleAtMinimumError,
    UnsupportedOptimizerError,
    ZeroConfig,
    ZeroConfigError,
    ZeroPrecision,
    ZeroStrategy,
)


def _trainer(world: int = 1, strategy="zero2", **kwargs) -> pl.Trainer:
    defaults = dict(accelerator="cpu", devices=world, strategy=strategy, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    limit_val_batches=0, max_steps=3)
    return pl.Trainer(**{**defaults, **kwargs})


def _fit(module: pl.LightningModule, world: int = 1, strategy="zero2", **kwargs) -> pl.Trainer:
    trainer = _trainer(world, strategy, **kwargs)
    trainer.fit(module, lm_data())
    return trainer


def _seeded(cls, *args):
    pl.seed_everything(0, verbose=False)
    return cls(*args)


# ---- registration -------------------------------------------------------------------------------
def test_import_registers_the_three_stages():
    importlib.reload(lightning_zero)  # importing (executing the package) twice must not fail
    for stage in (1, 2, 3):
        entry = StrategyRegistry[f"zero{stage}"]
        assert entry["strategy"].__name__ == "ZeroStrategy"
        assert entry["init_params"]["config"].stage == stage
        assert f"stage {stage}" in entry["description"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trainer_builds_strategy_from_name(stage):
    trainer = pl.Trainer(strategy=f"zero{stage}", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, lightning_zero.ZeroStrategy)
    assert trainer.strategy.config.stage == stage
    assert trainer.strategy.is_distributed


# ---- bad input ------------------------------------------------------------------------------------
def test_unknown_config_key():
    with pytest.raises(ZeroConfigError, match=r"Unknown ZeroConfig option 'stagee'.*Did you mean 'stage'"):
        ZeroStrategy(stagee=2)
    assert issubclass(ZeroConfigError, ValueError)


def test_invalid_config_value():
    with pytest.raises(ZeroConfigError, match=r"stage=5 is invalid: use 1, 2 or 3"):
        ZeroStrategy(stage=5)


class _WithOptimizer(TinyLM):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def configure_optimizers(self):
        return self.make(self)


def test_unsupported_optimizer_names_it_and_the_escape_hatch():
    module = _WithOptimizer(lambda m: torch.optim.Adafactor(m.parameters()))
    with pytest.raises(UnsupportedOptimizerError) as info:
        _fit(module)
    assert "Adafactor" in str(info.value) and "allow_untested_optimizer" in str(info.value)


@pytest.mark.parametrize("allow", [False, True])
def test_sparse_adam_is_refused_with_the_reason_not_the_opt_in(allow):
    module = _WithOptimizer(lambda m: torch.optim.SparseAdam(m.parameters()))
    with pytest.raises(UnsupportedOptimizerError, match="SparseAdam steps sparse gradients"):
        _fit(module, strategy=ZeroStrategy(stage=2, allow_untested_optimizer=allow))


@pytest.mark.parametrize("allow", [False, True])
def test_an_optimizer_whose_step_needs_the_closure_is_refused_even_when_untested_ones_are_allowed(allow):
    module = _WithOptimizer(lambda m: torch.optim.LBFGS(m.parameters()))
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS.step needs the closure"):
        _fit(module, strategy=ZeroStrategy(stage=2, allow_untested_optimizer=allow))


class PlainSGD(torch.optim.SGD):
    """Elementwise (p -= lr * g) but with its own step, so lightning_zero cannot know it is safe."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss


def _plain_sgd(module):
    return PlainSGD([p for p in module.parameters() if p.requires_grad], lr=0.1)


def test_custom_optimizer_refused_then_allowed():
    with pytest.raises(UnsupportedOptimizerError, match="PlainSGD"):
        _fit(_WithOptimizer(_plain_sgd))
    before = _seeded(TinyLM).state_dict()  # the initial values of both runs below
    zero, plain = _seeded(_WithOptimizer, _plain_sgd), _seeded(_WithOptimizer, _plain_sgd)
    _fit(zero, strategy=ZeroStrategy(allow_untested_optimizer=True))
    _fit(plain, strategy="ddp")  # reference (same DistributedSampler data order)
    assert zero.state_dict().keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        assert torch.allclose(zero.state_dict()[key], value, atol=1e-6), key
    assert not torch.equal(zero.fc1.weight, before["fc1.weight"])  # it really trained


def test_optimizer_with_foreign_tensor():
    extra = torch.zeros(3, requires_grad=True)
    module = _WithOptimizer(lambda m: torch.optim.SGD([*m.parameters(), extra], lr=0.1))
    with pytest.raises(ValueError, match=r"shape \(3,\) that is not a parameter of the model"):
        _fit(module)


def test_double_precision_refused():
    with pytest.raises(TypeError) as info:
        _fit(TinyLM(), precision="64-true")
    message = str(info.value)
    assert "DoublePrecision" in message and "'bf16-mixed'" in message and "'16-mixed'" in message


# ---- fp16 -------------------------------------------------------------------------------------------
class _Probe(TinyLM):
    def __init__(self):
        super().__init__()
        self.dtypes, self.scales, self.scaler_types = set(), [], set()

    def training_step(self, batch, batch_idx):
        self.dtypes |= {p.dtype for p in self.parameters() if p.requires_grad}
        scaler = self.trainer.precision_plugin.scaler
        self.scaler_types.add(type(scaler).__name__)
        self.scales.append((scaler.scale, scaler.dynamic))
        return super().training_step(batch, batch_idx)


def test_fp16_plugin_gives_real_fp16_and_default_scaler():
    module = _Probe()
    trainer = _fit(module, plugins=[ZeroPrecision("16-mixed")])
    assert isinstance(trainer.precision_plugin, ZeroPrecision)
    assert module.dtypes == {torch.float16}
    assert module.scaler_types == {"DynamicLossScaler"}
    assert module.scales[0] == (2.0**16, True)
    assert next(module.parameters()).dtype == torch.float32  # teardown hands back fp32


def test_fp16_static_loss_scale():
    module = _Probe()
    _fit(module, strategy=ZeroStrategy(config=ZeroConfig(loss_scale=128)), plugins=[ZeroPrecision("16-mixed")])
    assert module.dtypes == {torch.float16}
    assert module.scales == [(128.0, False)] * 3


class _AlwaysInf(TinyLM):
    def training_step(self, batch, batch_idx):
        return self._loss(batch) * math.inf


def test_loss_scale_at_minimum_error_names_parameters_and_bf16():
    cfg = ZeroConfig(initial_scale_power=2, min_loss_scale=1, hysteresis=1)
    with pytest.raises(LossScaleAtMinimumError) as info:
        _fit(_seeded(_AlwaysInf), strategy=ZeroStrategy(config=cfg), plugins=[ZeroPrecision("16-mixed")], max_steps=10)
    message = str(info.value)
    assert "fc1.weight" in message and "emb.weight" in message and "bf16" in message
    assert "frozen.weight" not in message  # frozen: no gradient at all


# ---- after fit ----------------------------------------------------------------------------------------
def test_state_dict_after_fit_is_the_trained_module():
    module = TinyLM()
    trainer = _fit(module)
    state = full_state(trainer)
    assert state.keys() == module.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in module.state_dict().items())


def test_memory_report_after_fit():
    trainer = _fit(TinyLM())
    assert trainer.strategy.memory_report().stage == 2


# ---- world 2: state dict, memory report, metrics --------------------------------------------------------
class _StateProbe(Callback):
    def on_train_end(self, trainer, pl_module):
        module_sd = pl_module.state_dict()
        self.module_meta = {k: (tuple(v.shape), str(v.dtype)) for k, v in module_sd.items()}
        self.full = {k: v.detach().clone() for k, v in full_state(trainer).items()}


class _MemoryProbe(Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 1:  # optimizer state exists after the first step; gradients are reduced
            report = trainer.strategy.memory_report()
            self.report, self.text = report.as_dict(), report.format()


class MLP(pl.LightningModule):
    """No frozen or tied parameters: every parameter has a gradient and optimizer state."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU(), nn.Linear(96, 8))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _mlp_data():
    return DataLoader(TensorDataset(torch.randn(32, 64, generator=torch.Generator().manual_seed(0))), batch_size=4)


class _Metrics(TinyLM):
    """Also keeps an unsynced accuracy, to show the ranks' data differ (so agreement is not trivial)."""

    def __init__(self):
        super().__init__()
        self.local = torchmetrics.classification.MulticlassAccuracy(num_classes=37, sync_on_compute=False)

    def validation_step(self, batch, batch_idx):
        (idx,) = batch
        self.local(self(idx[:, :-1]).float().reshape(-1, 37), idx[:, 1:].reshape(-1))
        return super().validation_step(batch, batch_idx)

    def on_validation_epoch_end(self):
        self.local_acc = float(self.local.compute())


def _world2(rank, world):
    out = {}
    for precision in ("32-true", "bf16-mixed"):
        probe, module = _StateProbe(), _seeded(TinyLM)
        _fit(module, world, precision=precision, callbacks=[probe])
        out[precision] = {"meta": probe.module_meta, "full": probe.full,
                          "after": {k: v.detach().clone() for k, v in module.state_dict().items()}}
    for stage in (1, 2):
        probe = _MemoryProbe()
        pl.seed_everything(0, verbose=False)
        _trainer(world, ZeroStrategy(stage=stage), callbacks=[probe]).fit(_seeded(MLP), _mlp_data())
        out[f"memory{stage}"] = {"report": probe.report, "text": probe.text,
                                 "psi": sum(p.numel() for p in MLP().parameters())}
    for strategy in ("ddp", "zero2"):
        module = _seeded(_Metrics)
        trainer = _fit(module, world, strategy, limit_val_batches=1.0)
        train_loss = float(trainer.callback_metrics["train_loss"])
        val = trainer.validate(module, lm_data(24), verbose=False)[0]
        out[strategy] = {"train_loss": train_loss, "val": {k: float(v) for k, v in val.items()},
                         "local_acc": module.local_acc}
    return out


@pytest.fixture(scope="module")
def world2():
    return run_ranks(_world2, 2, lightning=True)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightning_module_state_dict_full_on_every_rank(world2, precision):
    r0, r1 = world2[0][precision], world2[1][precision]
    for r in (r0, r1):
        assert set(r["full"]) == set(r["meta"]) and {"emb.weight", "head.weight"} <= set(r["full"])
        for key, (shape, _) in r["meta"].items():
            assert tuple(r["full"][key].shape) == shape, key
            assert r["full"][key].dtype == torch.float32, key
        if precision == "bf16-mixed":
            assert r["meta"]["fc1.weight"][1] == "torch.bfloat16"  # the module itself was bf16 then
        assert torch.equal(r["full"]["emb.weight"], r["full"]["head.weight"])
        for key, value in r["after"].items():  # the fp32 masters are what teardown hands back
            assert torch.equal(r["full"][key], value), key
    for key in r0["full"]:
        assert torch.equal(r0["full"][key], r1["full"][key]), key


def test_memory_report_speaks_in_the_papers_terms(world2):
    # the figures themselves are checked against the live storages in tests/test_memory_measured.py
    for r in world2:
        for key, stage, paper in (("memory1", 1, "4Ψ + 12Ψ/N"), ("memory2", 2, "2Ψ + 14Ψ/N")):
            rep, psi, text = r[key]["report"], r[key]["psi"], r[key]["text"]
            assert rep["num_params"] == psi and rep["world_size"] == 2 and rep["stage"] == stage
            assert f"stage {stage}" in text and paper in text
            assert rep["gradients_bytes"] > 0 and rep["optimizer_state_bytes"] > 0


def test_metrics_and_sync_dist_match_ddp(world2):
    for r in world2:
        for key in ("val_acc", "val_loss"):
            assert abs(r["zero2"]["val"][key] - r["ddp"]["val"][key]) < 1e-5, key
        assert abs(r["zero2"]["train_loss"] - r["ddp"]["train_loss"]) < 1e-5
        assert abs(r["zero2"]["local_acc"] - r["ddp"]["local_acc"]) < 1e-6
    for strategy in ("ddp", "zero2"):
        assert world2[0][strategy]["val"] == world2[1][strategy]["val"]
        assert world2[0][strategy]["train_loss"] == world2[1][strategy]["train_loss"]
        assert world2[0][strategy]["local_acc"] != world2[1][strategy]["local_acc"]  # each rank saw its own data


@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", torch.bfloat16), ("bf16-true", torch.bfloat16),
                                             ("32-true", torch.float32)])
def test_throughput_monitor_takes_the_peak_of_the_dtype_we_compute_in(monkeypatch, precision, dtype):
    # Lightning counts a precision plugin it does not know as fp32: its MFU would divide by the fp32 peak
    from lightning.fabric.utilities import throughput as fabric_throughput
    from lightning.pytorch.callbacks import ThroughputMonitor, throughput_monitor

    peaks = {torch.bfloat16: 1000.0, torch.float32: 10.0}
    fake = lambda device, wanted: peaks.get(wanted)  # noqa: E731 - the CPU has no table entry; stand-in peaks
    monkeypatch.setattr(fabric_throughput, "get_available_flops", fake)
    monkeypatch.setattr(throughput_monitor, "get_available_flops", fake)
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0])
    _trainer(precision=precision, callbacks=[monitor]).fit(TinyLM(), lm_data())
    assert monitor.available_flops == peaks[dtype]
    assert all(t.available_flops == peaks[dtype] for t in monitor._throughputs.values())
