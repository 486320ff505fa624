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

__all__ = ["MemoryReport", "memory_report"]

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

    @property
    def model_state(self) -> int:
        return sum(v for k, v in self.measured.items() if k != "comm_buffers")

    def as_dict(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "stage": self.stage, "num_params": self.num_params,
                **{f"{k}_bytes": v for k, v in self.measured.items()}, "model_state_bytes": self.model_state,
                "formula_paper_bytes": self.formula_paper, "formula_ours_bytes": self.formula_ours,
                "peak_gathered_bytes": self.peak_gathered, "window_gradients_bytes": self.window_gradients}

    def format(self) -> str:
        n, w = self.num_params, self.world_size
        lines = [f"lightning_zero memory report — rank {self.rank}/{w}, stage {self.stage}, Ψ = {n:,} parameters"]
        for key, value in self.measured.items():
            lines.append(f"  {key:<16} {_fmt(value):>12}")
        lines.append(f"  {'model state':<16} {_fmt(self.model_state):>12}   (parameters + gradients + master + "
                     f"optimizer state)")
        lines.append(f"  {'formula (ours)':<16} {_fmt(self.formula_ours):>12}   ({_ratio(self.model_state, self.formula_ours)} "
                     f"of it measured)")
        lines.append(f"  {'formula (paper)':<16} {_fmt(self.formula_paper):>12}   (ZeRO paper, mixed-precision Adam: "
                     f"{_paper_text(self.stage)})")
        if self.stage >= 3:
            lines.append(f"  {'peak gathered':<16} {_fmt(self.peak_gathered):>12}   (stage-3 working set, not model state)")
        if self.window_gradients:
            lines.append(f"  {'window grads':<16} {_fmt(self.window_gradients):>12}   (stage 1: full gradients held while a "
                         f"window accumulates, freed by its reduction)")
        return "\n".join(lines)


def _fmt(nbytes: int) -> str:
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
    return MemoryReport(rank=engine.comm.rank, world_size=w, stage=stage, num_params=n, measured=measured,
                        formula_paper=int(_paper(stage, n, w)),
                        formula_ours=int(_ours(engine, n, w, state_bytes_per_elem)),
                        peak_gathered=engine.gatherer.peak_gathered_bytes if engine.gatherer is not None else 0,
                        window_gradients=0 if engine.config.shard_grads else engine.reducer.window_full_bytes)


def _paper(stage: int, n: int, w: int) -> float:
    return {1: 4 * n + 12 * n / w, 2: 2 * n + 14 * n / w, 3: 16 * n / w}[stage]


def _ours(engine: ZeroEngine, n: int, w: int, k: float) -> float:
    p = torch.empty((), dtype=engine.compute_dtype).element_size()
    kept_full = not engine.config.shard_params
    master = 0 if kept_full and p == 4 else 4  # fp32 compute with a kept full buffer: the master is a view of it
    per_rank = (master + 4 + k) * n / w  # fp32 master, fp32 gradient shard, optimizer state
    if engine.config.shard_params:  # no 16-bit shard is kept: gathers cast the master
        return per_rank
    return per_rank + p * n  # stage 1's full gradients are gone by the step (see window_gradients)
