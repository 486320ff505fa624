"""Lightning's callbacks that restore a checkpoint, prune, reset weights by assignment, switch the optimizer or change
the accumulation, and an epoch that ends inside an accumulation window, train as under DDP (see
tests/builtin_callback_cases.py)."""

from __future__ import annotations

import pytest
import torch
from builtin_callback_cases import callback_many
from dist_utils import run_ranks
from parity import assert_parity

STRATEGIES = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
CASES = ("lr_finder", "pruning", "accumulation", "replace", "epoch_ends_mid_window", "switch_optimizer", "reset_state")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = [(s, c) for s in ("ddp", *STRATEGIES) for c in CASES]
    return run_ranks(callback_many, 2, runs, str(tmp_path_factory.mktemp("callbacks")), lightning=True)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", CASES)
def test_callback_trains_as_under_ddp(results, strategy, case):
    for rank in results:
        ref, run = rank[("ddp", case)], rank[(strategy, case)]
        assert run["steps"] == ref["steps"] > 0
        assert run["lr"] == pytest.approx(ref["lr"], rel=1e-6) and run["optimizer"] == ref["optimizer"]
        assert_parity(run, ref)
        if case == "replace":  # the tensors given by assignment followed the later steps, as DDP's parameter did
            assert len(run["given"]) == len(ref["given"]) == 3
            for ours, theirs in zip(run["given"], ref["given"]):
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_the_cases_change_what_they_claim(results):
    """The reference itself: the finder moved the rate, pruning zeroed weights, the assigned tensor is the trained
    weight at the end (so a parity failure above means a difference in training, not a case that does nothing)."""
    ref = results[0]
    assert ref[("ddp", "lr_finder")]["lr"] != pytest.approx(1e-2 * 0.5 ** 2)  # the suggestion, not the configured rate
    pruned = ref[("ddp", "pruning")]["state"]  # made permanent at the end: weights of which 30% a round are zero
    assert (pruned["blocks.0.weight"] == 0).float().mean() > 0.3
    final = ref[("ddp", "replace")]
    torch.testing.assert_close(final["given"][-1], final["state"]["head.weight"])
    assert not torch.equal(final["given"][0], final["given"][1])


def _fit_assigning(tmp_path, assign, precision="32-true", **options):
    import lightning.pytorch as pl
    from builtin_callback_cases import Regressor, data
    from lightning.pytorch.callbacks import Callback

    from lightning_zero import ZeroConfig, ZeroStrategy

    class Assign(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            self.given = assign(pl_module.head)

    pl.seed_everything(0, verbose=False)
    callback = Assign()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=options.pop("epochs", 2), precision=precision,
                         strategy=ZeroStrategy(config=ZeroConfig(**options)), logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[callback])
    trainer.fit(Regressor(), data())
    return trainer, callback


def test_assigned_fp32_data_keeps_its_bits_in_a_bf16_module(tmp_path):
    # after the last epoch: the value goes into the fp32 master at teardown, not rounded through the bf16 buffer
    def assign(head):
        given = torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(5))
        head.weight.data = given
        return given
    trainer, callback = _fit_assigning(tmp_path, assign, precision="bf16-mixed", stage=2, epochs=1)
    saved = trainer.strategy.full_state_dict()["head.weight"]
    assert saved.dtype == torch.float32 and torch.equal(saved, callback.given)


@pytest.mark.parametrize("options", [dict(stage=2), dict(stage=3)], ids=["zero2", "zero3"])
def test_assigning_data_of_another_shape_is_one_clear_error(tmp_path, options):
    from lightning_zero.engine.flat_unit import ReplacedParameterError

    def assign(head):
        head.weight.data = torch.zeros(2, 32)
    with pytest.raises(ReplacedParameterError, match=r"'head.weight' was given data of shape \(2, 32\).*\(1, 32\)"):
        _fit_assigning(tmp_path, assign, **options)


def test_assigning_data_under_nvme_offload_is_one_clear_error(tmp_path):
    from lightning_zero.engine.flat_unit import ReplacedParameterError

    def assign(head):
        head.weight.data = torch.zeros(1, 32)
    with pytest.raises(ReplacedParameterError, match="NVMe or delayed_step"):
        _fit_assigning(tmp_path, assign, stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path))


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_data_assigned_after_fit_is_what_validate_and_the_next_fit_use(tmp_path, strategy):
    import lightning.pytorch as pl
    from builtin_callback_cases import Regressor, _strategy, data

    class Validated(Regressor):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", (self(batch[0]) - batch[1]).pow(2).mean())

    out = {}
    for name in ("ddp", strategy):
        pl.seed_everything(0, verbose=False)
        module = Validated()
        kwargs = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
        trainer = pl.Trainer(max_epochs=1, strategy=_strategy(name), **kwargs)
        trainer.fit(module, data())
        module.head.weight.data = torch.full((1, 32), 0.25)
        val = trainer.validate(module, data(), verbose=False)[0]["val_loss"]
        again = pl.Trainer(max_epochs=1, strategy=_strategy(name), **kwargs)
        again.fit(module, data())
        out[name] = (val, module.losses)
    assert out[strategy][0] == pytest.approx(out["ddp"][0], rel=1e-6)
    assert out[strategy][1] == pytest.approx(out["ddp"][1], rel=1e-5)


def test_state_by_parameter_reaches_this_ranks_piece():
    """[Note: state by parameter]: a module parameter as key means its piece here; one this rank holds none of has
    nothing to read or change; other keys (the pieces themselves, as the step uses them) are plain."""
    import copy
    from collections import defaultdict

    from lightning_zero.engine.optim import PieceKeyedState

    here, elsewhere, piece = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4)), torch.zeros(2)
    table = {id(here): piece, id(elsewhere): None}
    state = PieceKeyedState(dict, resolve=lambda k: (id(k) in table, table.get(id(k))))
    state[piece]["exp_avg"] = torch.ones(2)  # the step's own use
    assert here in state and state[here] is state[piece] and state.get(here) is state[piece]
    assert elsewhere not in state and state.get(elsewhere, "none") == "none"
    assert state[elsewhere]["exp_avg"].numel() == 0  # reads as empty, changes nothing
    state[elsewhere] = {"step": 1}
    del state[elsewhere]
    assert len(state) == 1 and state.pop(elsewhere, None) is None
    state[here] = {"step": torch.tensor(3.0)}
    assert state[piece]["step"] == 3
    del state[here]
    assert piece not in state and here not in state
    state[here]["exp_avg"] = torch.zeros(2)  # defaultdict as torch's: a new entry, under the piece
    assert list(state) == [piece]
    state["note"] = 1  # a key that is no tensor is plain too
    assert "note" in state and state["note"] == 1 and state.pop("note") == 1
    plain = copy.deepcopy(state)
    assert type(plain) is defaultdict and len(plain) == 1
