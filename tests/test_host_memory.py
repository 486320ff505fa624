"""The host budget (MemAvailable, cgroup v1/v2 limits, ranks of the node) and the refusal before allocating.

/proc and /sys are fake trees here (``read_host_budget(root=...)``; the strategy reads the tree named by
``LIGHTNING_ZERO_HOST_ROOT``), so every case is exact.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import ZeroStrategy
from lightning_zero.host_memory import (
    HEADROOM_MIN,
    MARGIN,
    HostMemoryError,
    read_host_budget,
    shortfall,
)
from lightning_zero.planner import GiB, Hardware, choose, estimate, recommend_partial

G = 2**30


def fake_host(root: Path, available: int, cgroup: str = "", files: dict | None = None) -> Path:
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/meminfo").write_text(f"MemTotal:  999999999 kB\nMemAvailable: {available // 1024} kB\n")
    (root / "proc/self/cgroup").write_text(cgroup)
    for rel, text in (files or {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_without_a_limit_the_budget_is_mem_available_shared_by_the_ranks(tmp_path):
    root = fake_host(tmp_path, 100 * G, "0::/\n", {"sys/fs/cgroup/memory.max": "max\n"})
    budget = read_host_budget(4, root=root)
    assert budget.node_free == 100 * G and budget.per_rank == 25 * G and budget.cgroup_limit is None
    assert "MemAvailable" in budget.source


def test_a_cgroup_v2_limit_bounds_it_with_reclaimable_cache_counted_free(tmp_path):
    root = fake_host(tmp_path, 100 * G, "0::/job/step\n", {
        "sys/fs/cgroup/job/memory.max": str(8 * G), "sys/fs/cgroup/job/memory.current": str(3 * G),
        "sys/fs/cgroup/job/memory.stat": f"anon 100\ninactive_file {G}\n",
        "sys/fs/cgroup/job/step/memory.max": "max", "sys/fs/cgroup/job/step/memory.current": str(3 * G)})
    budget = read_host_budget(2, root=root)
    assert budget.node_free == 6 * G and budget.per_rank == 3 * G  # 8 - 3 + 1 (inactive file pages)
    assert budget.cgroup_limit == 8 * G and "sys/fs/cgroup/job/memory.max" in budget.source


def test_a_cgroup_v1_limit_inside_a_namespace(tmp_path):
    # /proc/self/cgroup names a path the namespaced mount does not have: the mount's root is this cgroup
    root = fake_host(tmp_path, 50 * G, "4:memory:/slurm/uid_1/job_7\n0::/\n", {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": str(20 * G),
        "sys/fs/cgroup/memory/memory.usage_in_bytes": str(4 * G)})
    budget = read_host_budget(1, root=root)
    assert budget.node_free == 16 * G and budget.cgroup_free == 16 * G
    unlimited = fake_host(tmp_path / "u", 50 * G, "4:memory:/\n", {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": str(4 * G)})
    assert read_host_budget(1, root=unlimited).node_free == 50 * G  # v1's "no limit" value


def test_memavailable_below_the_limit_wins(tmp_path):
    root = fake_host(tmp_path, 5 * G, "0::/\n", {"sys/fs/cgroup/memory.max": str(64 * G),
                                                 "sys/fs/cgroup/memory.current": str(G)})
    assert read_host_budget(1, root=root).node_free == 5 * G


def test_the_refusal_names_bytes_budget_and_ways_out(tmp_path):
    root = fake_host(tmp_path, 100 * G, "0::/\n", {"sys/fs/cgroup/memory.max": str(40 * G),
                                                   "sys/fs/cgroup/memory.current": "0"})
    budget = read_host_budget(2, root=root)
    assert shortfall(int(19 * G / (1 + MARGIN)), budget, "x") is None
    message = shortfall(25 * G, budget, "ZeroStrategy (zero2 offload cpu)")
    assert "25.0 GiB of host memory per rank" in message and "20.0 GiB per rank" in message
    assert "cgroup limit 40.0 GiB" in message and "offload_fraction" in message and "nvme" in message
    assert "\n" not in message


def test_the_last_bytes_are_never_planned(tmp_path):
    # 3% of what bounds the budget (the cgroup limit here, else MemTotal) stays with the system, at least 256 MiB
    root = fake_host(tmp_path, 100 * G, "0::/\n", {"sys/fs/cgroup/memory.max": str(40 * G),
                                                   "sys/fs/cgroup/memory.current": "0"})
    budget = read_host_budget(2, root=root)
    assert budget.headroom == int(0.03 * 40 * G) and budget.headroom_per_rank == budget.headroom // 2
    fits = int((budget.per_rank - budget.headroom_per_rank) / (1 + MARGIN))
    assert shortfall(fits, budget, "x") is None and shortfall(fits + 2**20, budget, "x") is not None
    small = fake_host(tmp_path / "small", 100 * G, "0::/\n", {"sys/fs/cgroup/memory.max": str(G),
                                                              "sys/fs/cgroup/memory.current": "0"})
    assert read_host_budget(1, root=small).headroom == HEADROOM_MIN


class _Tiny(pl.LightningModule):
    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-3, amsgrad=self.optimizer == "amsgrad")


def _fit(monkeypatch, root: Path, callbacks=(), module: pl.LightningModule | None = None, **options) -> pl.Trainer:
    assert lightning_zero
    monkeypatch.setenv("LIGHTNING_ZERO_HOST_ROOT", str(root))
    trainer = pl.Trainer(accelerator="cpu", devices=1,
                         strategy=ZeroStrategy(stage=2, offload_optimizer="cpu", **options),
                         max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(module or _Tiny(), DataLoader(TensorDataset(torch.randn(8, 64)), batch_size=4))
    return trainer


class _TakeMemoryAfterSetup(pl.Callback):
    """What dataloader workers or another process do between setup and the first step: the job's cgroup fills."""

    def __init__(self, usage_file: Path, usage: int) -> None:
        self.usage_file, self.usage = usage_file, usage
        self.pending: list[int] = []

    def on_train_start(self, trainer, pl_module):
        self.pending.append(trainer.strategy.engine.offloader.pending_host_bytes(trainer.optimizers))
        self.usage_file.write_text(str(self.usage))

    def on_train_end(self, trainer, pl_module):
        self.engine = trainer.strategy.engine  # (released after fit)


def test_the_first_step_checks_again_what_it_will_allocate(tmp_path, monkeypatch):
    usage = tmp_path / "sys/fs/cgroup/memory.current"
    root = fake_host(tmp_path, 100 * G, "0::/\n", {"sys/fs/cgroup/memory.max": str(2 * G),
                                                   "sys/fs/cgroup/memory.current": "0"})
    numel = sum(p.numel() for p in _Tiny().parameters())
    # the room left after setup is 64 KiB short of the headroom plus the AdamW moments the first step creates
    taken = _TakeMemoryAfterSetup(usage, 2 * G - HEADROOM_MIN - 8 * numel + 65536)
    with pytest.raises(HostMemoryError, match=r"first optimizer step would allocate 0\.00 GiB.*taken since setup"):
        _fit(monkeypatch, root, [taken])
    assert taken.pending == [8 * numel]  # exp_avg and exp_avg_sq, fp32, every offloaded element
    usage.write_text("0")
    enough = _TakeMemoryAfterSetup(usage, 2 * G - HEADROOM_MIN - 8 * numel - 65536)
    _fit(monkeypatch, root, [enough])  # 64 KiB more room: it trains


@pytest.mark.parametrize("optimizer,per_elem", [("adamw", 8), ("amsgrad", 12), ("sgd", 4)])
def test_pending_host_bytes_is_the_state_the_first_step_creates(tmp_path, monkeypatch, optimizer, per_elem):
    root = fake_host(tmp_path, 100 * G)
    probe = _TakeMemoryAfterSetup(tmp_path / "unused", 0)
    trainer = _fit(monkeypatch, root, [probe], _Tiny(optimizer), offload_fraction=0.5, reduce_bucket_size=5000)
    engine = probe.engine
    offloader = engine.offloader
    assert 0 < offloader.offloaded_numel < sum(p.numel() for p in trainer.lightning_module.parameters())
    # what the optimizer really created next to the offloaded pieces (their elements, not the units' padding):
    # the bytes predicted before the first step; nothing is pending now
    pieces = [engine.piece_of(p) for unit in offloader.units for p in unit.params]
    state = trainer.optimizers[0].state
    created = sum(v.numel() * v.element_size() for piece in pieces for k, v in state[piece].items()
                  if k != "step" and torch.is_tensor(v))
    assert probe.pending == [created] == [per_elem * sum(piece.numel() for piece in pieces)]
    assert offloader.pending_host_bytes(trainer.optimizers) == 0


def test_partial_offload_fraction_is_found_to_the_percent():
    hw = Hardware(gpu_bytes=int(80 * GiB), host_bytes=int(500 * GiB))
    n = 7_000_000_000
    row = recommend_partial(n, hw, stage=2, activations=int(10 * GiB))
    fraction = row.config.offload_fraction
    assert row.fits and round(fraction * 100) == fraction * 100
    below = estimate(n, row.config.replace(offload_fraction=fraction - 0.01), hw, activations=int(10 * GiB))
    assert not below.fits  # one percent less does not fit: the smallest fraction
    assert fraction % 0.05 > 1e-9  # a multiple of 5% would have been the old 5% grid


def test_zero_auto_names_its_choice_and_the_runner_up():
    hw = Hardware(gpu_bytes=int(139 * GiB), host_bytes=int(125 * GiB))
    chosen = choose(13_000_000_000, hw, lightning_zero.ZeroConfig(auto_placement=True), activations=int(4 * GiB),
                    tokens_per_step=8 * 2048)
    assert chosen.runner_up is not None and chosen.runner_up.name != chosen.name
    assert "runner-up" in chosen.why and chosen.runner_up.name in chosen.why and "s a step" in chosen.why


def test_each_rank_takes_its_share_of_the_cores_for_the_host_step():
    from lightning_zero.host_memory import host_threads

    assert host_threads(cores=16, ranks_on_node=8, current=16, user_set=False) == 2
    assert host_threads(cores=16, ranks_on_node=1, current=16, user_set=False) == 14  # two for the loop and copies
    assert host_threads(cores=32, ranks_on_node=2, current=32, user_set=False) == 14
    assert host_threads(cores=16, ranks_on_node=1, current=12, user_set=False) is None  # already no more
    assert host_threads(cores=4, ranks_on_node=1, current=4, user_set=False) is None  # small shares stay whole
    assert host_threads(cores=16, ranks_on_node=8, current=16, user_set=True) is None  # OMP_NUM_THREADS wins
    assert host_threads(cores=4, ranks_on_node=8, current=4, user_set=False) == 1


def _two_ranks_first_step(rank: int, world: int, root: str, usage: int) -> str:
    import os

    os.environ["LIGHTNING_ZERO_HOST_ROOT"] = root
    taken = _TakeMemoryAfterSetup(Path(root) / "sys/fs/cgroup/memory.current", usage)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=ZeroStrategy(stage=2, offload_optimizer="cpu"),
                         max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[taken] if rank == 1 else [])
    try:
        trainer.fit(_Tiny(), DataLoader(TensorDataset(torch.randn(8, 64)), batch_size=4))
    except HostMemoryError as error:
        return str(error)
    return "trained"


def test_every_rank_stops_when_one_rank_sees_the_host_short(tmp_path):
    from dist_utils import run_ranks

    root = fake_host(tmp_path, 100 * G, "0::/\n", {"sys/fs/cgroup/memory.max": str(2 * G),
                                                   "sys/fs/cgroup/memory.current": "0"})
    # rank 1 fills the job's cgroup after setup and before rank 0 reads it: both ranks stop, neither hangs
    results = run_ranks(_two_ranks_first_step, 2, str(root), 2 * G - 2**20, lightning=True, timeout=240)
    assert all("first optimizer step would allocate" in r for r in results), results


def test_host_bytes_given_back_before_allocating_count_as_free(tmp_path):
    # a module built in host memory is copied to the GPU unit by unit as the engine builds, and freed there,
    # before the offloaded state is allocated: its bytes are host memory the placement may use
    root = fake_host(tmp_path, 100 * G, "0::/\n", {"sys/fs/cgroup/memory.max": str(40 * G),
                                                   "sys/fs/cgroup/memory.current": str(10 * G)})
    plain, back = read_host_budget(2, root=root), read_host_budget(2, root=root, returning=5 * G)
    assert plain.node_free == 30 * G and back.node_free == 40 * G  # each rank gives back its own copy
    assert back.per_rank == plain.per_rank + 5 * G
    assert "5.0 GiB per rank held now and given back" in back.describe()
    assert "given back" not in plain.describe()
    needed = int((back.per_rank - back.headroom_per_rank) / (1 + MARGIN)) - 2**20
    assert shortfall(needed, plain, "x") is not None and shortfall(needed, back, "x") is None


class _Blocks(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])  # 12 x 4.2 MB, one unit each

    def training_step(self, batch, batch_idx):
        return self.blocks(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_the_module_in_host_memory_is_given_back_unit_by_unit_as_the_engine_builds(monkeypatch):
    # What the credit above relies on: as each unit is built, the module's own copy of its parameters dies.
    # Measured with the live CPU storages at every unit built: never more than the module plus one unit and
    # the unit being built (keeping the module alive beside the engine's copies would reach twice the module).
    from storage_probe import live_storages

    from lightning_zero.engine.flat_unit import FlatUnit

    module = _Blocks()
    module_bytes = sum(p.numel() * 4 for p in module.parameters())
    unit_bytes = 4 * (1024 * 1024 + 1024)
    base = sum(live_storages().values()) - module_bytes
    seen: list[int] = []
    build = FlatUnit.build

    def counted(self, *args, **kwargs):
        build(self, *args, **kwargs)
        seen.append(sum(live_storages().values()) - base)

    monkeypatch.setattr(FlatUnit, "build", counted)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=3, wrap_modules=("Linear",)),
                         max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(8, 1024)), batch_size=4))
    assert len(seen) == 12
    assert max(seen) <= module_bytes + 2 * unit_bytes + 2**20, (max(seen) / 2**20, module_bytes / 2**20)


def test_what_the_engine_does_not_flatten_goes_to_the_device_metric_states_included():
    # the meta device stands for the GPU: a torchmetrics Metric keeps its states as plain attributes that only its
    # own .to() moves (a metric left on the host failed every GPU fit that updates one)
    import torchmetrics

    from lightning_zero.engine.materialize import move_all_but_flattened

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer, self.norm = nn.Linear(3, 3), nn.BatchNorm1d(3)
            self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
            self.metrics = nn.ModuleDict({"mean": torchmetrics.MeanMetric()})

    model = Model()
    move_all_but_flattened(model, torch.device("meta"))
    assert model.layer.weight.device.type == "cpu"  # the engine copies it unit by unit
    assert model.norm.running_mean.is_meta and model.acc.tp.is_meta and model.metrics["mean"].mean_value.is_meta
    assert model.acc.device.type == "meta"
