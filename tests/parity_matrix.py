"""The parity matrix: every zoo pattern × strategy × precision × accumulation × clipping against DDP.

A cell is one fit on 2 CPU ranks (gloo); its reference is DDP on the same ranks with the same
precision, accumulation and clipping.

fp32 cells are held to ``fp32_bound``: 1e-5, or ``ROUNDING_FACTOR`` x how far DDP itself moves when
only rounding changes (the reference run again from weights one ulp away), whichever is larger.
ZeRO-2/3 add micro-batch gradients after reducing them, DDP before, and clipping sums the norm in
another order: mathematically the same training, in floating point a different rounding, which
some patterns amplify past 1e-5 over their steps (and a faster or slower CPU kernel changes it
again). The nudged run measures that amplification for the cell at hand, on the machine at hand. A cell compares, on every rank, every logged loss; and
on rank 0 the trained fp32 weights (``trainer.strategy.full_state_dict()``, the documented way
to read them) and each optimizer's full state (``trainer.strategy.full_optimizer_state_dict()``):
per-parameter tensors, step counts and every param group's hyperparameters.

CI runs one slice of the matrix per run (``chosen_slice``): the cells are dealt into ``SLICES``
slices by a fixed shuffle, and the slice is the day number (or ``PARITY_SLICE``), so that
consecutive runs cover every cell. ``make parity-full`` runs them all (``PARITY_SLICE=all``).
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

import lightning.pytorch as pl
import parity_zoo as zoo
import torch
from lightning.pytorch.strategies import DDPStrategy

import lightning_zero
from lightning_zero import ZeroConfig, ZeroStrategy

STRATEGIES = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
# on 4 ranks too (fp32, accumulation 2, clipping on): one pattern of each kind
WORLD4_PATTERNS = ("gpt_tied", "gan", "shared_loss", "lora", "backbone_ft", "moe", "batchnorm", "hf_gpt2")
# in-place edits of the parameters between steps reach the fp32 master of units gathered on the device; the
# matrix's zero3 shards every group (placeholders: an error, tests/test_stage3.py) and offloaded masters are not
# reached yet (README: "Editing parameters in place")
EDIT_PATTERNS = ("weight_clip",)
# zero_auto picks its placement at setup and may move after its first step: every pattern once (accumulation 2,
# clipping on), in each precision the pattern runs in
AUTO = "zero_auto"
SLICES = 2
FP32_TOL = 1e-5
ROUNDING_FACTOR = 4.0  # measured over the 420 cells: ZeRO's distance from DDP at most 1.1x the nudged run's
NUDGED = "nudged"  # the results key of the reference's nudged run


@dataclass(frozen=True, order=True)
class Cell:
    pattern: str
    strategy: str  # one of STRATEGIES, or "ddp" for a reference
    precision: str  # "32-true" | "bf16-mixed"
    accumulate: int
    clip: bool
    world: int = 2

    @property
    def name(self) -> str:
        return (f"{self.pattern}-{self.strategy}-{self.precision}-acc{self.accumulate}-{'clip' if self.clip else 'noclip'}"
                + (f"-world{self.world}" if self.world != 2 else ""))

    def with_(self, **changes) -> Cell:
        fields = dict(pattern=self.pattern, strategy=self.strategy, precision=self.precision,
                      accumulate=self.accumulate, clip=self.clip, world=self.world)
        return Cell(**{**fields, **changes})

    @property
    def reference(self) -> Cell:
        return self.with_(strategy="ddp")


def all_cells() -> list[Cell]:
    cells = []
    for pattern in zoo.PATTERNS:
        precisions = ("32-true", "bf16-mixed") if pattern in zoo.BF16_PATTERNS else ("32-true",)
        for strategy in STRATEGIES:
            if pattern in EDIT_PATTERNS and strategy.startswith("zero3"):  # sharded groups: an edit is an error
                continue
            for precision in precisions:
                for accumulate in (1, 2):
                    for clip in (False, True):
                        cells.append(Cell(pattern, strategy, precision, accumulate, clip))
    cells += [Cell(pattern, strategy, "32-true", 2, True, world=4) for pattern in WORLD4_PATTERNS
              for strategy in STRATEGIES]
    cells += [Cell(pattern, AUTO, precision, 2, True) for pattern in zoo.PATTERNS
              for precision in (("32-true", "bf16-mixed") if pattern in zoo.BF16_PATTERNS else ("32-true",))]
    return cells


def chosen_slice() -> str:
    """``PARITY_SLICE`` (a number, or "all"), else today's day number modulo ``SLICES``."""
    wanted = os.environ.get("PARITY_SLICE", "").strip()
    if wanted:
        return wanted
    return str(int(time.time() // 86400) % SLICES)


def cells_of_slice(which: str) -> list[Cell]:
    cells = all_cells()
    if which == "all":
        return cells
    order = list(range(len(cells)))
    random.Random(0).shuffle(order)  # a fixed deal: each slice mixes patterns and strategies
    index = int(which) % SLICES
    return sorted(cells[i] for k, i in enumerate(order) if k % SLICES == index)


def groups(cells: list[Cell]) -> dict[Cell, list[Cell]]:
    """Cells by reference (one process pair per group: a failure stays in its group)."""
    out: dict[Cell, list[Cell]] = {}
    for cell in cells:
        out.setdefault(cell.reference, []).append(cell)
    return out


# ---- one fit -----------------------------------------------------------------------------------------------
class WrapAllDDP(DDPStrategy):
    """DDP that registers every parameter with its reducer, frozen ones included.

    Stock DDP leaves out parameters frozen when it wraps the model and never synchronizes their
    gradients after a later unfreeze (BackboneFinetuning, a callback's add_param_group): its ranks
    drift apart (tests/test_parity_matrix.py shows it). Registering every parameter keeps the ranks
    equal; a frozen parameter simply gets no gradient, as with find_unused_parameters.
    """

    def configure_ddp(self) -> None:
        frozen = [p for p in self.model.parameters() if not p.requires_grad]
        for p in frozen:
            p.requires_grad_(True)
        try:
            super().configure_ddp()
        finally:
            for p in frozen:
                p.requires_grad_(False)


def make_strategy(name: str, stock_ddp: bool = False):
    if name == "ddp":
        cls = DDPStrategy if stock_ddp else WrapAllDDP
        return cls(find_unused_parameters=True)
    if name == AUTO:
        return ZeroStrategy(config=AUTO)
    stage = int(name[4])
    options = dict(stage=stage, reduce_bucket_size=1500)  # several units even for the small patterns
    if stage == 3:
        options.update(min_group_params=500, param_persistence_threshold=0)  # several gathered groups
    if name.endswith("offload"):
        options.update(offload_optimizer="cpu", offload_params="cpu" if stage == 3 else "none")
    return ZeroStrategy(config=ZeroConfig(**options))


def fit_cell(cell: Cell, world: int, stock_ddp: bool = False, every_rank: bool = False, nudge: bool = False) -> dict:
    """Train ``cell`` on this rank; return what the comparison reads (weights and optimizer state on rank 0, or
    on every rank with ``every_rank``: DDP's weights are each rank's own). ``nudge`` moves every initial weight by
    one unit in the last place (see ``nudge_by_one_ulp``)."""
    assert lightning_zero
    pl.seed_everything(0, verbose=False)
    module = zoo.build(cell.pattern, cell.accumulate, cell.clip)
    if nudge:
        nudge_by_one_ulp(module)
    automatic = module.automatic_optimization
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=make_strategy(cell.strategy, stock_ddp),
                         precision=cell.precision, max_epochs=zoo.EPOCHS.get(cell.pattern, 1),
                         accumulate_grad_batches=cell.accumulate if automatic else 1,
                         gradient_clip_val=(zoo.CLIP if automatic and cell.clip and not getattr(module, "own_clipping", False)
                                            else None),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=module.callbacks() if hasattr(module, "callbacks") else None)
    trainer.fit(module, module.data())
    strategy = trainer.strategy
    if isinstance(strategy, ZeroStrategy):
        weights = strategy.full_state_dict()
        optim = [strategy.full_optimizer_state_dict(opt) for opt in trainer.optimizers]
    else:
        weights = module.state_dict()
        optim = [opt.state_dict() for opt in trainer.optimizers]
    out = {"losses": list(module.losses), "global_step": trainer.global_step}
    if trainer.global_rank == 0 or every_rank:
        out["weights"] = {k: v.detach().float().cpu().clone() for k, v in weights.items()}
        out["optim"] = [_cpu(o) for o in optim]
    return out


def nudge_by_one_ulp(module: torch.nn.Module) -> None:
    """Move each floating-point weight up or down by one unit in the last place (a fixed pattern, the same on every
    rank): a run from these weights differs from the reference only by rounding, so its distance from the
    reference measures how much this training amplifies rounding (``rounding_bound``)."""
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point():
                up = torch.rand(p.shape, generator=gen) < 0.5
                p.copy_(torch.where(up, torch.nextafter(p, torch.full_like(p, float("inf"))),
                                    torch.nextafter(p, torch.full_like(p, float("-inf")))))


def _cpu(state: dict) -> dict:
    return {"state": {i: {k: (v.detach().float().cpu().clone() if torch.is_tensor(v) else v) for k, v in e.items()}
                      for i, e in state["state"].items()},
            "param_groups": [dict(g) for g in state["param_groups"]]}


def run_group(rank: int, world: int, reference: Cell, cells: list[Cell], extra_refs: list[Cell]) -> dict:
    """Every fit of one group on this rank (an fp32 reference also nudged, under ``NUDGED``); a failing fit is
    reported, not raised (the ranks stay in step only as long as no rank raises, so the first error ends the group)."""
    out: dict = {}
    fits = [(reference, False), *((c, False) for c in extra_refs), *((c, False) for c in cells)]
    if reference.precision == "32-true":
        fits.insert(1, (reference, True))
    for cell, nudge in fits:
        start = time.perf_counter()
        key = NUDGED if nudge else cell
        out[key] = fit_cell(cell, world, nudge=nudge)
        out[key]["seconds"] = time.perf_counter() - start
    return out


# ---- comparison -----------------------------------------------------------------------------------------------
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item() if b.numel() else 0.0
    diff = (a.float() - b.float()).abs().max().item() if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


def losses_err(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), f"{len(a)} losses logged, the reference logged {len(b)}"
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)


def weights_err(a: dict, b: dict) -> tuple[float, str]:
    assert a.keys() == b.keys(), f"state dict keys differ: {sorted(a.keys() ^ b.keys())}"
    worst = max(((rel_err(a[k], b[k]), k) for k in b), default=(0.0, ""))
    return worst


def optim_err(a: list[dict], b: list[dict]) -> tuple[float, str]:
    """Largest relative error over every optimizer's per-parameter state; hyperparameters and steps must be equal."""
    assert len(a) == len(b), f"{len(a)} optimizers, the reference has {len(b)}"
    worst = (0.0, "")
    for k, (mine, ref) in enumerate(zip(a, b)):
        assert len(mine["param_groups"]) == len(ref["param_groups"]), f"optimizer {k}: param group count"
        for g, (gm, gr) in enumerate(zip(mine["param_groups"], ref["param_groups"])):
            for key in gr:
                if key in ("params", "initial_lr") or key not in gm:
                    continue
                assert gm[key] == gr[key] or _close(gm[key], gr[key]), \
                    f"optimizer {k} group {g} {key}: {gm[key]} vs the reference's {gr[key]}"
            assert list(gm["params"]) == list(gr["params"]), f"optimizer {k} group {g}: parameter numbering"
        assert mine["state"].keys() == ref["state"].keys(), \
            f"optimizer {k}: state for parameters {sorted(mine['state'])} vs the reference's {sorted(ref['state'])}"
        for i, entry in ref["state"].items():
            for key, value in entry.items():
                got = mine["state"][i][key]
                if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                    worst = max(worst, (rel_err(got, value), f"optimizer {k} param {i} {key}"))
                else:
                    assert float(got) == float(value), f"optimizer {k} param {i} {key}: {got} vs {value}"
    return worst


def _close(a, b) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    try:
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(b)))
    except (TypeError, ValueError):
        return False


def fp32_bound(ref: dict, nudged: dict) -> dict[str, float]:
    """Per measure: the larger of ``FP32_TOL`` and ``ROUNDING_FACTOR`` x the nudged reference's distance."""
    return {what: max(FP32_TOL, ROUNDING_FACTOR * err) for what, (err, _) in errors(nudged, ref).items()}


def errors(run: dict, ref: dict) -> dict[str, tuple[float, str]]:
    """Per rank: losses; rank 0 also weights and optimizer state."""
    out = {"losses": (losses_err(run["losses"], ref["losses"]), "")}
    if "weights" in ref:
        out["weights"] = weights_err(run["weights"], ref["weights"])
        out["optimizer"] = optim_err(run["optim"], ref["optim"])
    return out


# ---- 16-bit cells ----------------------------------------------------------------------------------------------
def l2_err(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over every tensor together (a few tiny biases do not decide it)."""
    num = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in b)
    den = sum(float(b[k].float().pow(2).sum()) for k in b)
    return (num / den) ** 0.5 if den else num ** 0.5


def optim_tensors(states: list[dict]) -> dict:
    return {(k, i, key): v for k, s in enumerate(states) for i, e in s["state"].items() for key, v in e.items()
            if key != "step" and torch.is_tensor(v) and v.is_floating_point()}


def distance(run: dict, ref: dict) -> dict[str, float]:
    """Global distances of a 16-bit run from a reference: mean relative loss difference, L2 of weights and of
    optimizer state (rank 0)."""
    a, b = run["losses"], ref["losses"]
    assert len(a) == len(b)
    out = {"losses": sum(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)) / max(len(b), 1)}
    if "weights" in ref:
        out["weights"] = l2_err(run["weights"], ref["weights"])
        mine, theirs = optim_tensors(run["optim"]), optim_tensors(ref["optim"])
        assert mine.keys() == theirs.keys()
        out["optimizer"] = l2_err(mine, theirs)
    return out
