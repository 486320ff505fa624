"""The parity matrix (tests/parity_matrix.py): a slice of it per run, the whole of it with
``make parity-full``. fp32 cells equal DDP at 1e-5 or within a few times DDP's own rounding
sensitivity (``fp32_bound``); 16-bit cells are held to a tolerance measured
from DDP's own 16-bit spread (see BF16_FACTOR)."""

from __future__ import annotations

import parity_matrix as pm
import pytest
from dist_utils import run_ranks
from parity import SIXTEEN_BIT_FACTOR
from parity_matrix import Cell

SLICE = pm.chosen_slice()
CELLS = pm.cells_of_slice(SLICE)
GROUPS = pm.groups(CELLS)
BF16_FACTOR = SIXTEEN_BIT_FACTOR  # see parity.py: the measured bound and its negative control (below)
_results: dict[Cell, object] = {}
WRONG_LR = 0.05  # the bf16 bound's negative control: a learning rate 5% off is caught on every machine we ran
WRONG_GRAD_FP32 = 0.001  # the fp32 bound's: gradients 0.1% too large (a learning rate off shows in the hyperparameters)


def _group(reference: Cell) -> list:
    if reference not in _results:
        extra = [reference.with_(precision="32-true")] if reference.precision != "32-true" else []
        try:
            _results[reference] = run_ranks(pm.run_group, reference.world, reference, GROUPS[reference], extra,
                                            lightning=True, timeout=600)
        except Exception as err:  # noqa: BLE001 - every cell of the group reports it
            _results[reference] = err
    found = _results[reference]
    if isinstance(found, Exception):
        raise found
    return found


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS, ids=[c.name for c in CELLS])
def test_cell_matches_ddp(cell):
    ranks = _group(cell.reference)
    for rank, results in enumerate(ranks):
        run, ref = results[cell], results[cell.reference]
        assert run["global_step"] == ref["global_step"] > 0
        if cell.precision == "32-true":
            bound = pm.fp32_bound(ref, results[pm.NUDGED])
            for what, (err, where) in pm.errors(run, ref).items():
                assert err <= bound[what], (f"rank {rank}: {what} differ from DDP by {err:.2e} ({where}); bound "
                                            f"{bound[what]:.2e} (DDP from weights one ulp away: "
                                            f"{bound[what] / pm.ROUNDING_FACTOR:.2e})")
        else:
            truth = results[cell.reference.with_(precision="32-true")]
            spread, mine = pm.distance(ref, truth), pm.distance(run, truth)
            for what in spread:
                assert mine[what] <= BF16_FACTOR * spread[what], (
                    f"rank {rank}: {what} are {mine[what]:.2e} from fp32 DDP; DDP's own bf16 is {spread[what]:.2e} "
                    f"away (bound: {BF16_FACTOR}x)")


def test_slices_cover_the_matrix_once():
    every = pm.all_cells()
    dealt = [c for k in range(pm.SLICES) for c in pm.cells_of_slice(str(k))]
    assert sorted(dealt) == sorted(every) and len(set(dealt)) == len(every)
    assert len({c.pattern for c in every}) == len(pm.zoo.PATTERNS) >= 13
    assert pm.cells_of_slice("all") == every


def _controls(rank: int, world: int) -> dict:
    ft = Cell("backbone_ft", "ddp", "32-true", 1, False)
    bf16 = Cell("gpt_tied", "ddp", "bf16-mixed", 1, False)
    pm.zoo.LR_SCALE = 1.0
    out = {"stock": pm.fit_cell(ft, world, stock_ddp=True, every_rank=True),
           "wrap_all": pm.fit_cell(ft, world, every_rank=True),
           "fp32": pm.fit_cell(bf16.with_(precision="32-true"), world), "bf16": pm.fit_cell(bf16, world)}
    out["fp32_nudged"] = pm.fit_cell(bf16.with_(precision="32-true"), world, nudge=True)
    pm.zoo.LR_SCALE = 1.0 + WRONG_LR  # a subtle bug: a learning rate slightly off
    out["bf16_wrong_lr"] = pm.fit_cell(bf16, world)
    pm.zoo.LR_SCALE = 1.0
    pm.zoo.GRAD_SCALE = 1.0 + WRONG_GRAD_FP32
    out["fp32_wrong_grad"] = pm.fit_cell(bf16.with_(precision="32-true"), world)
    pm.zoo.GRAD_SCALE = 1.0
    return out


@pytest.fixture(scope="module")
def controls():
    return run_ranks(_controls, 2, lightning=True)


@pytest.mark.slow
def test_reference_ddp_keeps_its_ranks_equal_where_stock_ddp_does_not(controls):
    # Stock DDP never synchronizes parameters that were frozen when it wrapped the model: after
    # BackboneFinetuning unfreezes them, its ranks train different backbones. The matrix's reference
    # registers every parameter and keeps them equal.
    r0, r1 = controls
    assert pm.weights_err(r0["stock"]["weights"], r1["stock"]["weights"])[0] > 1e-3
    assert pm.weights_err(r0["wrap_all"]["weights"], r1["wrap_all"]["weights"])[0] == 0.0
    assert r0["stock"]["losses"][:6] == r0["wrap_all"]["losses"][:6]  # epoch 0, backbone frozen: the same training


@pytest.mark.slow
def test_bf16_bound_catches_a_learning_rate_five_percent_off(controls):
    # a cell fails when any rank exceeds the bound on any measure, as test_cell_matches_ddp checks it
    worst = 0.0
    for r in controls:
        spread = pm.distance(r["bf16"], r["fp32"])
        wrong = pm.distance(r["bf16_wrong_lr"], r["fp32"])
        worst = max(worst, *(wrong[k] / spread[k] for k in spread))
    assert worst > BF16_FACTOR


@pytest.mark.slow
def test_fp32_bound_catches_gradients_a_tenth_of_a_percent_off(controls):
    r0 = controls[0]  # weights and optimizer state are compared on rank 0, losses on every rank
    bound = pm.fp32_bound(r0["fp32"], r0["fp32_nudged"])
    wrong = pm.errors(r0["fp32_wrong_grad"], r0["fp32"])
    assert any(wrong[k][0] > bound[k] for k in bound), (wrong, bound)
