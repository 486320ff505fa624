"""zero_auto out of GPU memory in its first step: it plans again with room for what was asked and trains on,
without losing the step (the same weights as a run that never ran out). One rank, in this process; the
"GPU" is the planner's model of one (a small budget), and the module raises torch's out-of-memory error
whenever the placement the strategy runs would not leave it the activation memory it needs."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import planner
from lightning_zero.replan import OOM, requested_bytes

ACTIVATIONS = 32 * 2**20
N_PARAMS = 1024 * 2048 + 2048 + 2048 + 1  # the MLP below: 2.1M parameters, 25 MB of fp32 AdamW state


class NeedsActivationRoom(pl.LightningModule):
    def __init__(self, hw=None, where: str = "forward") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1))
        self.hw, self.where, self.ooms, self.losses = hw, where, 0, []

    def _check(self) -> None:
        strategy = self.trainer.strategy
        if self.hw is None or not hasattr(strategy, "config"):
            return
        row = planner.estimate(N_PARAMS, strategy.config, self.hw, compute_bytes=4)
        if row.gpu_total + ACTIVATIONS > row.gpu_total_cap:
            self.ooms += 1
            raise OOM(f"CUDA out of memory. Tried to allocate {ACTIVATIONS / 2**20:.2f} MiB. GPU 0 has ...")

    def training_step(self, batch, batch_idx):
        if self.where == "forward":
            self._check()
        loss = self.net(batch[0]).pow(2).mean()
        if self.where == "backward":
            loss.register_hook(lambda grad: self._check())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(strategy, module, steps=4):
    assert lightning_zero
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)  # the same batches under every strategy
    g = torch.Generator().manual_seed(1)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(32, 1024, generator=g)), batch_size=8))
    return trainer


def _small_gpu() -> planner.Hardware:
    """A budget in which zero2 fits without activations but not with them, and offloading fits with them."""
    plain = planner.estimate(N_PARAMS, lightning_zero.ZeroConfig(stage=2), planner.Hardware(), compute_bytes=4)
    return planner.Hardware(gpu_bytes=int((plain.gpu_total + ACTIVATIONS // 4) / planner.HEADROOM),
                            host_bytes=64 * 2**30)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_in_the_first_step_plans_again_and_loses_no_step(monkeypatch, where):
    hw = _small_gpu()
    monkeypatch.setattr(planner, "hardware_here", lambda *args, **kwargs: hw)
    pl.seed_everything(0, verbose=False)
    module = NeedsActivationRoom(hw, where)
    with pytest.warns(UserWarning, match="out of GPU memory in the first step under zero2; planned again"):
        trainer = _fit("zero_auto", module)
    assert module.ooms == 1 and trainer.strategy.config.offloads and trainer.global_step == 4
    pl.seed_everything(0, verbose=False)
    reference = NeedsActivationRoom()
    _fit("auto", reference)  # plain single-device training
    got = trainer.strategy.full_state_dict()  # any stage (stage 3 keeps the module sharded)
    for name, value in reference.state_dict().items():
        assert torch.allclose(got[name], value, rtol=1e-5, atol=1e-6), name
    assert module.losses[-4:] == pytest.approx(reference.losses, rel=1e-5)  # the same four steps


def test_out_of_memory_after_the_first_step_is_not_hidden(monkeypatch):
    hw = _small_gpu()
    monkeypatch.setattr(planner, "hardware_here", lambda *args, **kwargs: hw)

    class LateOOM(NeedsActivationRoom):
        def training_step(self, batch, batch_idx):
            if self.global_step == 2:
                raise OOM("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super().training_step(batch, batch_idx)

    with pytest.raises(OOM, match="Tried to allocate 2.00 GiB"):
        _fit("zero_auto", LateOOM(None))


def test_requested_bytes_is_read_from_torch_messages():
    assert requested_bytes("CUDA out of memory. Tried to allocate 1.50 GiB (GPU 0; 79.1 GiB total)") == int(1.5 * 2**30)
    assert requested_bytes("Tried to allocate 20.00 MiB") == 20 * 2**20
    assert requested_bytes("out of memory") == 0


# ---- the first step as a probe: the plan follows the measured activations -----------------------------------------
WIDE_PARAMS = 1024 * 2048 + 2048 + 2048 * 8192 + 8192 + 8192 + 1  # the wider MLP below: 18.9M parameters
USED = 40 * 2**20  # the activation bytes the simulated GPU reports for its first step


class Wide(NeedsActivationRoom):
    """Raises torch's out-of-memory error when the running placement leaves less than USED for activations."""

    def __init__(self, hw=None) -> None:
        super().__init__(hw)
        self.net = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 8192), nn.ReLU(),
                                 nn.Linear(8192, 1))

    def _check(self) -> None:
        strategy = self.trainer.strategy
        if self.hw is not None and hasattr(strategy, "config"):
            row = planner.estimate(self.n_params, strategy.config, self.hw, compute_bytes=4)
            if row.gpu_total + USED > row.gpu_total_cap:
                self.ooms += 1
                raise OOM(f"CUDA out of memory. Tried to allocate {USED / 2**20:.2f} MiB.")

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class SimulatedMeter:
    """The allocator peak a CUDA run reads in its first step: here the simulated GPU's figure."""

    def __init__(self, used: int) -> None:
        self.used, self.starts = used, 0

    def start(self, device) -> None:
        self.starts += 1

    def read(self):
        return self.used if self.starts else None


def _gpu_of(total: int):
    """hardware_here for a simulated GPU of ``total`` bytes (honouring the share zero_auto keeps back)."""
    def here(device, gpus_per_node, nodes, config, activation_share=planner.ACTIVATION_SHARE, host_returning=0):
        return planner.Hardware(gpu_bytes=int(total * (1 - activation_share)), host_bytes=64 * 2**30)
    return here


def _probe_gpu(n_params: int) -> int:
    """A GPU on which zero2 does not fit while a quarter is kept for activations, and fits with what the first
    step measured (with the margin)."""
    z2 = planner.estimate(n_params, lightning_zero.ZeroConfig(stage=2), planner.Hardware(), compute_bytes=4)
    total = int((z2.gpu_total + int(planner_margin(USED) * 1.05)) / planner.HEADROOM)
    assert z2.gpu_total > (1 - planner.ACTIVATION_SHARE) * total * planner.HEADROOM, "the share must rule zero2 out"
    return total


def planner_margin(used: int) -> int:
    from lightning_zero.replan import Replanner

    r = Replanner()
    r.measured = used
    return r.planned_activations()


def _fit_probed(module, meter, steps=4):
    assert lightning_zero
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="zero_auto", max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    trainer.strategy._auto.replanner.meter = meter
    g = torch.Generator().manual_seed(1)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(32, 1024, generator=g)), batch_size=8))
    return trainer


def _same_as_plain_training(module) -> Wide:
    """``module`` ends with the weights of the same batches trained without lightning_zero; that run."""
    pl.seed_everything(0, verbose=False)
    reference = Wide()
    _fit("auto", reference)
    got = {k: v.detach() for k, v in module.state_dict().items()}
    for name, value in reference.state_dict().items():
        assert torch.allclose(got[name], value, rtol=1e-5, atol=1e-6), name
    return reference


def test_the_first_step_measures_and_moves_to_a_lighter_placement_without_losing_the_step(monkeypatch):
    total = _probe_gpu(WIDE_PARAMS)
    monkeypatch.setattr(planner, "hardware_here", _gpu_of(total))
    hw = planner.Hardware(gpu_bytes=total, host_bytes=64 * 2**30)
    first = planner.choose(WIDE_PARAMS, _gpu_of(total)(None, 1, 1, None), lightning_zero.ZeroConfig(),
                           compute_bytes=4).name
    assert first != "zero2"
    pl.seed_everything(0, verbose=False)
    module, meter = Wide(hw), SimulatedMeter(USED)
    assert module.n_params == WIDE_PARAMS
    with pytest.warns(UserWarning, match=f"first step used 0.04 GiB for activations, less than kept free: moved from "
                                         f"{first} to zero2 and ran the step again"):
        trainer = _fit_probed(module, meter)
    assert trainer.strategy.config.stage == 2 and not trainer.strategy.config.offloads
    assert module.ooms == 0 and trainer.global_step == 4 and trainer.strategy._auto.replanner.measured == USED
    reference = _same_as_plain_training(module)
    assert module.losses[-4:] == pytest.approx(reference.losses, rel=1e-5)
    assert len(module.losses) == 5  # the first batch ran twice (probe, then under zero2), no other


def test_a_measurement_that_needs_the_room_keeps_the_placement(monkeypatch, caplog):
    total = _probe_gpu(WIDE_PARAMS)
    monkeypatch.setattr(planner, "hardware_here", _gpu_of(total))
    module = Wide(None)
    with caplog.at_level("INFO"):
        # more than zero2 leaves room for (with the margin), less than the running placement does
        used, full = 60 * 2**20, _gpu_of(total)(None, 1, 1, None, 0.0)
        first = planner.choose(WIDE_PARAMS, _gpu_of(total)(None, 1, 1, None), lightning_zero.ZeroConfig(),
                               compute_bytes=4).config
        assert planner.estimate(WIDE_PARAMS, first, full, compute_bytes=4, activations=planner_margin(used)).fits
        assert not planner.estimate(WIDE_PARAMS, lightning_zero.ZeroConfig(stage=2), full, compute_bytes=4,
                                    activations=planner_margin(used)).fits
        trainer = _fit_probed(module, SimulatedMeter(used))
    assert trainer.strategy.config.to_dict()["stage"] != 2 or trainer.strategy.config.offloads
    assert len(module.losses) == 4  # no batch ran twice
    assert "first step used" in caplog.text and "stays" in caplog.text


def test_no_move_when_the_host_cannot_take_the_module_back(monkeypatch, caplog):
    from lightning_zero import host_memory

    total = _probe_gpu(WIDE_PARAMS)
    monkeypatch.setattr(planner, "hardware_here", _gpu_of(total))
    tiny = host_memory.HostBudget(per_rank=32 * 2**20, node_free=32 * 2**20, ranks_on_node=1,
                                  mem_available=32 * 2**20, cgroup_free=None, cgroup_limit=None, source="a test")
    monkeypatch.setattr(host_memory, "read_host_budget", lambda *args, **kwargs: tiny)
    module = Wide(None)
    with caplog.at_level("INFO"):
        trainer = _fit_probed(module, SimulatedMeter(USED))
    assert trainer.strategy.config.stage != 2 or trainer.strategy.config.offloads
    assert len(module.losses) == 4
    assert "needs the fp32 module (0.1 GiB) in host memory" in caplog.text


def test_nothing_measured_on_the_cpu_keeps_the_first_plan(monkeypatch):
    total = _probe_gpu(WIDE_PARAMS)
    monkeypatch.setattr(planner, "hardware_here", _gpu_of(total))
    module = Wide(None)
    trainer = _fit_probed(module, __import__("lightning_zero.replan", fromlist=["PeakMeter"]).PeakMeter())
    assert trainer.strategy._auto.replanner.measured is None and len(module.losses) == 4


def test_a_provisional_plan_when_nothing_fits_with_the_share(monkeypatch):
    """zero_auto at the edge (the 13B case): with a quarter of the GPU kept back nothing fits; on a GPU it plans
    with less kept back and says the plan is provisional; on the CPU it refuses as before."""
    need = planner.estimate(WIDE_PARAMS, lightning_zero.ZeroConfig(stage=3, offload_optimizer="cpu",
                                                                   offload_params="cpu"), planner.Hardware(),
                            compute_bytes=4).gpu_total
    small = int(need / planner.HEADROOM / (1 - planner.ACTIVATION_FLOOR)) + 2**20
    assert need > small * (1 - planner.ACTIVATION_SHARE) * planner.HEADROOM
    monkeypatch.setattr(planner, "hardware_here", _gpu_of(small))
    module = Wide(None)

    class Cuda:
        type = "cuda"

    config, why = planner.plan_for_run(module, Cuda(), 1, 1, lightning_zero.ZeroConfig(), torch.float32, 1)
    assert "provisional" in why and lightning_zero.ZeroConfig.from_dict(config).offloads
    with pytest.raises(ValueError, match="No placement fits"):
        planner.plan_for_run(module, torch.device("cpu"), 1, 1, lightning_zero.ZeroConfig(), torch.float32, 1)


BIG = 200 * 2**20  # activations the running placement has no room for beside the optimizer state still to come


class NeedsStateRoom(Wide):
    """Forward and backward fit; the optimizer step (its state created) runs out of memory when the running
    placement has no room for that state beside the activations (the margin included) the first step needed."""

    def on_before_optimizer_step(self, optimizer) -> None:
        row = planner.estimate(self.n_params, self.trainer.strategy.config, self.hw, compute_bytes=4,
                               activations=planner_margin(BIG))
        if not row.fits:
            self.ooms += 1
            raise OOM(f"CUDA out of memory. Tried to allocate {BIG / 2**20:.2f} MiB.")


def test_a_measurement_the_placement_has_no_room_for_moves_to_one_that_fits(monkeypatch):
    z2 = planner.estimate(WIDE_PARAMS, lightning_zero.ZeroConfig(stage=2), planner.Hardware(), compute_bytes=4)
    total = int(z2.gpu_total / ((1 - planner.ACTIVATION_SHARE) * planner.HEADROOM) * 1.02)  # zero2 fits the share
    monkeypatch.setattr(planner, "hardware_here", _gpu_of(total))
    hw = planner.Hardware(gpu_bytes=total, host_bytes=64 * 2**30)
    assert planner.choose(WIDE_PARAMS, _gpu_of(total)(None, 1, 1, None), lightning_zero.ZeroConfig(),
                          compute_bytes=4).name == "zero2"
    assert not planner.estimate(WIDE_PARAMS, lightning_zero.ZeroConfig(stage=2), hw, compute_bytes=4,
                                activations=planner_margin(BIG)).fits, "zero2 must lack the room"
    pl.seed_everything(0, verbose=False)
    module = NeedsStateRoom(hw)
    with pytest.warns(UserWarning, match="first step used 0.20 GiB for activations, more than zero2 leaves room for "
                                         "beside the optimizer state its first step creates: moved from zero2 to "
                                         "zero2 offload cpu"):
        trainer = _fit_probed(module, SimulatedMeter(BIG))
    assert trainer.strategy.config.offloads and module.ooms == 0 and trainer.global_step == 4
    _same_as_plain_training(module)
    assert len(module.losses) == 5  # the first batch ran twice, no step lost


def test_no_placement_with_room_for_the_measurement_warns(monkeypatch):
    z2 = planner.estimate(WIDE_PARAMS, lightning_zero.ZeroConfig(stage=2), planner.Hardware(), compute_bytes=4)
    total = int(z2.gpu_total / ((1 - planner.ACTIVATION_SHARE) * planner.HEADROOM) * 1.02)
    monkeypatch.setattr(planner, "hardware_here", _gpu_of(total))
    module = Wide(None)
    with pytest.warns(UserWarning, match="no placement leaves enough: zero2 stays and may run out of GPU memory"):
        trainer = _fit_probed(module, SimulatedMeter(total))  # the whole GPU for activations: nothing fits
    assert trainer.strategy.config.stage == 2 and len(module.losses) == 4


def test_a_new_placement_takes_the_parameters_from_the_host_itself():
    # the engine copies each unit's parameters to the device as it builds it: before that only buffers (and
    # parameters it does not flatten) move, not the whole fp32 module (which would sit on the GPU beside the new
    # placement's masters). "meta" stands in for the GPU here.
    class OnMeta(lightning_zero.ZeroStrategy):
        @property
        def root_device(self):
            return torch.device("meta")

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.register_parameter("count", nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False))
    strategy = OnMeta(config="zero_auto")
    strategy.model = model
    strategy.model_to_device()
    assert model[0].weight.device.type == "cpu" and model[1].weight.device.type == "cpu"
    assert model[1].running_mean.device.type == "meta" and model.count.device.type == "meta"


def test_the_lightning_module_reports_the_device_the_strategy_placed_it_on():
    # without .to() Lightning's record of the device stays "cpu": a step's torch.zeros(..., device=self.device)
    # would land in host memory on a GPU run. "meta" stands in for the GPU.
    class OnMeta(lightning_zero.ZeroStrategy):
        @property
        def root_device(self):
            return torch.device("meta")

    for built_on in ("cpu", "meta"):
        with torch.device(built_on):
            module = Wide(None)
        strategy = OnMeta(config="zero2")
        strategy.model = module
        strategy.model_to_device()
        assert module.device == torch.device("meta") and module.net[0].weight.device.type == built_on


def test_the_first_placement_is_freed_before_the_next_is_built(monkeypatch):
    # Lightning still holds the first batch's loss (its graph) and the first optimizer while the new placement is
    # built, and the engine sits in reference cycles: on a GPU the old masters outlived the move and the new
    # placement ran out of memory beside them. The collector is off during the fit, so only the strategy's own
    # release can free them; checked when the new engine is about to be built.
    import gc
    import weakref

    total = _probe_gpu(WIDE_PARAMS)
    monkeypatch.setattr(planner, "hardware_here", _gpu_of(total))
    real = planner.plan_for_run

    def stage3_first(*args, measured=None, **kwargs):  # a first placement with gathers, hooks and offload
        if measured is None:
            return [lightning_zero.ZeroConfig(stage=3, offload_optimizer="cpu", offload_fraction=0.7).to_dict(), "test"]
        return real(*args, measured=measured, **kwargs)

    monkeypatch.setattr(planner, "plan_for_run", stage3_first)
    seen = {}

    class Watch(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            engine = trainer.strategy.engine
            seen["engine"] = weakref.ref(engine)
            seen["tensors"] = [weakref.ref(t) for u in engine.units
                               for t in [u.master, *u.pieces] if t is not None]
            seen["bytes"] = sum(r().untyped_storage().nbytes() for r in seen["tensors"])

    pl.seed_everything(0, verbose=False)
    module = Wide(None)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="zero_auto", max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[Watch()])
    strategy = trainer.strategy
    strategy._auto.replanner.meter = SimulatedMeter(USED)
    rebuild = strategy.model_to_device

    def measured_rebuild():  # also called at setup, before the first engine exists
        if "engine" in seen:
            alive = [r() for r in seen["tensors"] if r() is not None]
            seen["at_rebuild"] = (seen["engine"]() is None, sum(t.untyped_storage().nbytes() for t in alive))
        rebuild()

    strategy.model_to_device = measured_rebuild
    gc.disable()
    try:
        with pytest.warns(UserWarning, match="moved from zero3 offload cpu 70% to zero2"):
            trainer.fit(module, DataLoader(TensorDataset(torch.randn(32, 1024)), batch_size=8))
    finally:
        gc.enable()
    assert seen["bytes"] >= 4 * WIDE_PARAMS  # the masters and the pieces viewing them
    assert seen["at_rebuild"] == (True, 0)


def test_zero_auto_in_cpu_training_names_the_cpu_not_a_gpu():
    """On a CPU-only machine the ranks compute in host memory: the plan's line says so, never "GPU"."""
    config, why = planner.plan_for_run(torch.nn.Linear(8, 8), torch.device("cpu"), 1, 1,
                                       lightning_zero.ZeroConfig(), torch.float32, 1)
    assert "GPU" not in why and "GiB CPU" in why, why
    assert lightning_zero.ZeroConfig.from_dict(config).stage == 2


def test_the_measured_first_step_moves_every_rank_together():
    """Two ranks: each reads its own first-step peak (rank 1's four times rank 0's); the largest counts, rank 0
    decides, both move to zero2 and run the first batch again: the same training as zero2 from the start."""
    import replan_cases
    from dist_utils import run_ranks

    for r in run_ranks(replan_cases.measured_on_two_ranks, 2, lightning=True, timeout=600):
        assert r["first"] != "zero2"
        assert r["config"]["stage"] == 2 and r["config"]["offload_optimizer"] == "none"
        assert r["measured"] == USED
        assert len(r["losses"]) == 5 and r["losses"][1:] == pytest.approx(r["reference_losses"], rel=1e-6)
        for name, value in r["reference"].items():
            assert torch.allclose(r["state"][name], value, rtol=1e-6, atol=1e-7), name
