"""The memory report: per-rank bytes of model state, measured and as the formulas predict.

Measured bytes are read off the tensors the engine and the optimizer hold. Two formulas
stand beside them: the ZeRO paper's (mixed-precision Adam: 16-bit parameters and
gradients, fp32 master and two moments) and lightning_zero's own, which counts what this
implementation allocates (its gradient shard is fp32, so accumulation is exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .engine import ZeroEngine

__all__ = ["MemoryReport", "memory_report", "fmt_bytes"]

GiB = float(2**30)


@dataclass
class MemoryReport:
    """Per-rank bytes by category, with the formulas for the same run."""

    rank: int
    world_size: int
    stage: int
    num_params: int  # Ψ: parameters of the model (tied ones once), sharded or not
    measured: dict[str, int] = field(default_factory=dict)
    formula_paper: int = 0
    formula_ours: int = 0
    peak_gathered: int = 0  # stage 3: the largest set of gathered groups alive at once
    window_gradients: int = 0  # stage 1: full gradient buffers of the last window (freed by its reduction)
    offloaded: dict[str, int] = field(default_factory=dict)  # "host" / "nvme": bytes of the offloaded units' state
    planned_device: int = 0  # lightning_zero.planner: model state on the device (buffers excluded)
    planned_host: int = 0
    planned_nvme: int = 0

    @property
    def device_state(self) -> int:
        return self.model_state - sum(self.offloaded.values())

    @property
    def model_state(self) -> int:
        return sum(v for k, v in self.measured.items() if k != "comm_buffers")

    def as_dict(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "stage": self.stage, "num_params": self.num_params,
                **{f"{k}_bytes": v for k, v in self.measured.items()}, "model_state_bytes": self.model_state,
                "formula_paper_bytes": self.formula_paper, "formula_ours_bytes": self.formula_ours,
                "peak_gathered_bytes": self.peak_gathered, "window_gradients_bytes": self.window_gradients,
                "offloaded_host_bytes": self.offloaded.get("host", 0), "offloaded_nvme_bytes": self.offloaded.get("nvme", 0),
                "device_state_bytes": self.device_state, "planned_device_bytes": self.planned_device,
                "planned_host_bytes": self.planned_host, "planned_nvme_bytes": self.planned_nvme}

    def format(self) -> str:
        n, w = self.num_params, self.world_size
        lines = [f"lightning_zero memory report — rank {self.rank}/{w}, stage {self.stage}, Ψ = {n:,} parameters"]
        for key, value in self.measured.items():
            lines.append(f"  {key:<16} {fmt_bytes(value):>12}")
        lines.append(f"  {'model state':<16} {fmt_bytes(self.model_state):>12}   (parameters + gradients + master + "
                     f"optimizer state)")
        lines.append(f"  {'formula (ours)':<16} {fmt_bytes(self.formula_ours):>12}   ({_ratio(self.model_state, self.formula_ours)} "
                     f"of it measured)")
        lines.append(f"  {'formula (paper)':<16} {fmt_bytes(self.formula_paper):>12}   (ZeRO paper, mixed-precision Adam: "
                     f"{_paper_text(self.stage)})")
        if self.stage >= 3:
            lines.append(f"  {'peak gathered':<16} {fmt_bytes(self.peak_gathered):>12}   (stage-3 working set, not model state)")
        if self.offloaded or self.planned_host:
            lines.append(f"  {'offloaded':<16} {fmt_bytes(self.offloaded.get('host', 0)):>12} host, "
                         f"{fmt_bytes(self.offloaded.get('nvme', 0))} NVMe files")
        lines.append(f"  {'planned':<16} {fmt_bytes(self.planned_device):>12} device, {fmt_bytes(self.planned_host)} host, "
                     f"{fmt_bytes(self.planned_nvme)} NVMe   (lightning_zero.estimate; measured device "
                     f"{_ratio(self.device_state, self.planned_device)} of it)")
        if self.window_gradients:
            lines.append(f"  {'window grads':<16} {fmt_bytes(self.window_gradients):>12}   (stage 1: full gradients held while a "
                         f"window accumulates, freed by its reduction)")
        return "\n".join(lines)


def fmt_bytes(nbytes: int) -> str:
    return f"{nbytes / GiB:.3f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.2f} MiB"


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.1%}" if b else "n/a"


def _paper_text(stage: int) -> str:
    return {1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N", 3: "16Ψ/N"}[stage]


class _Storages:
    """Bytes of distinct storages: a view (a fp32 master inside ``full``, a gradient piece) counts once."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def size(self, t: Optional[torch.Tensor]) -> int:
        if t is None:
            return 0
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in self.seen:
            return 0
        self.seen.add(storage.data_ptr())
        return storage.nbytes()


def memory_report(engine: ZeroEngine) -> MemoryReport:
    """Measure ``engine`` now (call after at least one step for the optimizer state to exist)."""
    n, w, stage = 0, engine.comm.world_size, engine.config.stage
    measured = {"parameters": 0, "gradients": 0, "fp32_master": 0, "optimizer_state": 0, "comm_buffers": 0}
    storages = _Storages()
    managed = set()
    for unit in engine.units:
        n += unit.layout.numel
        managed.update(id(p) for p in unit.params)
        if not engine.config.shard_params:  # stage 3: gathered units are working set, not model state
            measured["parameters"] += storages.size(unit.full)
    for unit in engine.units:
        measured["fp32_master"] += storages.size(unit.master)
        if unit.param_shard is not None and unit.param_shard.device == engine.device and unit.after_param_io is None:
            measured["parameters"] += storages.size(unit.param_shard)  # offloaded stage-3 unit's gather source
    for unit in engine.units:
        measured["gradients"] += storages.size(unit.grad_shard)
        key = "comm_buffers" if engine.config.shard_grads else "gradients"
        measured[key] += storages.size(unit.grad_full)
    for p in engine.module.parameters():
        if id(p) not in managed:
            n += p.numel()
            measured["parameters"] += storages.size(p)
    pieces = {id(q) for u in engine.units for q in u.pieces if q is not None}
    for optimizer in engine.optimizers:
        for key, value in optimizer.state.items():
            if id(key) in pieces:
                for tensor in value.values():
                    if isinstance(tensor, torch.Tensor):
                        measured["optimizer_state"] += storages.size(tensor)
    # Gradients live from backward to the step, which frees them: between steps, report what the
    # last step held (the report is about model state, not about the moment it is read).
    if not any(u.grad_shard is not None for u in engine.units):
        measured["gradients"] += engine.grad_bytes_at_step
    shard_elems = sum(u.layout.shard_numel for u in engine.units) or 1
    state_bytes_per_elem = measured["optimizer_state"] / shard_elems
    offloaded = offloaded_bytes(engine)
    planned = _planned(engine, n, state_bytes_per_elem)
    return MemoryReport(offloaded=offloaded, planned_device=planned[0], planned_host=planned[1], planned_nvme=planned[2],
                        **_base(engine, n, w, stage, measured, state_bytes_per_elem))


def _base(engine: ZeroEngine, n: int, w: int, stage: int, measured: dict, state_bytes_per_elem: float) -> dict:
    return dict(rank=engine.comm.rank, world_size=w, stage=stage, num_params=n, measured=measured,
                        formula_paper=int(_paper(stage, n, w)),
                        formula_ours=int(_ours(engine, n, w, state_bytes_per_elem)),
                        peak_gathered=engine.gatherer.peak_gathered_bytes if engine.gatherer is not None else 0,
                        window_gradients=0 if engine.config.shard_grads else engine.reducer.window_full_bytes)


def offloaded_bytes(engine: ZeroEngine) -> dict[str, int]:
    """Bytes of the offloaded units' master, gradient arena and optimizer state, by where they live."""
    off = engine.offloader
    if off is None:
        return {}
    nvme = off.store is not None and off.store.masters
    pieces = {id(q) for u in off.units for q in u.pieces if q is not None}
    state = sum(t.numel() * t.element_size() for o in engine.optimizers for k, v in o.state.items() if id(k) in pieces
                for t in v.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    masters = sum(u.layout.shard_numel * 4 for u in off.units)
    host = off.grads.nbytes + (0 if nvme else masters + state)
    out = {"host": host}
    if off.store is not None:  # master and optimizer state files (parameter-shard files are not model state here)
        out["nvme"] = sum(f.nbytes for (_, key), f in off.store.files.items() if key != "param")
    return out


def _planned(engine: ZeroEngine, n: int, state_bytes: float) -> tuple[int, int, int]:
    """The planner's model-state bytes for this engine's configuration (device without buffers, host, NVMe)."""
    from ..planner import Hardware, estimate

    p = torch.empty((), dtype=engine.compute_dtype).element_size()
    shard = max((u.layout.numel for u in engine.units), default=0)
    config = engine.config
    if engine.offloader is not None:  # whole units move: plan with the share that really moved
        total = sum(u.layout.shard_numel for u in engine.units) or 1
        config = config.replace(offload_fraction=engine.offloader.offloaded_numel / total)
    row = estimate(n, config, Hardware(gpus_per_node=1, nodes=engine.comm.world_size), compute_bytes=p,
                   state_bytes=round(state_bytes), largest_unit=shard)
    host = row.host - (engine.config.nvme_buffer_bytes if engine.config.offload_optimizer == "nvme" else 0)
    return row.gpu_state - row.gpu_buffers, host, row.nvme


def _paper(stage: int, n: int, w: int) -> float:
    return {1: 4 * n + 12 * n / w, 2: 2 * n + 14 * n / w, 3: 16 * n / w}[stage]


def _ours(engine: ZeroEngine, n: int, w: int, k: float) -> float:
    p = torch.empty((), dtype=engine.compute_dtype).element_size()
    kept_full = not engine.config.shard_params
    master = 0 if kept_full and p == 4 else 4  # fp32 compute with a kept full buffer: the master is a view of it
    # offloaded units: their fp32 master is a host copy whatever the compute dtype; in stage 3 without
    # offload_params the device keeps a compute-dtype shard of them to gather from
    off = engine.offloader.offloaded_numel / (sum(u.layout.shard_numel for u in engine.units) or 1) \
        if engine.offloader is not None else 0.0
    # master and state for every managed element, the fp32 gradient shard for the trainable ones only (frozen
    # parameters sit in units of their own, which never get a gradient); stage 3's parameters are placeholders
    trainable = sum(shape.numel() for u in engine.units for p, shape in zip(u.params, u.shapes) if p.requires_grad)
    per_rank = ((master + k) * (1 - off) + (4 + k) * off) * n / w + 4 * trainable / w
    if engine.config.shard_params:  # no 16-bit shard is kept: gathers cast the master
        gather_source = p * off * n / w if engine.config.offload_params == "none" else 0.0
        return per_rank + gather_source
    return per_rank + p * n  # stage 1's full gradients are gone by the step (see window_gradients)
