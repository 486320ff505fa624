"""Lightning's StochasticWeightAveraging and EMAWeightAveraging train as under DDP: stages 1-3 (sharded stage 3:
their hooks gather the whole model), CPU offload, bf16."""

from __future__ import annotations

import pytest
import torch
from averaging_cases import run_all, run_ema_resumed
from dist_utils import run_ranks
from parity import assert_16bit_close, assert_parity, loss_err

from lightning_zero.checkpoint.export import write_checkpoint

pytest.importorskip("lightning.pytorch.callbacks", reason="Lightning")
KINDS = ("swa", "ema")
STRATEGIES = ("zero1", "zero2", "zero2_offload", "zero3", "zero3_sharded")
BF16 = ("zero2", "zero3_sharded")


def _runs() -> list[tuple[str, str, str]]:
    fp32 = [(s, k, "32-true") for k in KINDS for s in ("ddp", *STRATEGIES)] + [("ddp", "none", "32-true")]
    return fp32 + [(s, k, "bf16-mixed") for k in KINDS for s in ("ddp", *BF16)]


@pytest.fixture(scope="module")
def world2():
    return run_ranks(run_all, 2, _runs(), lightning=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_averaging_trains_as_ddp(world2, strategy, kind):
    for results in world2:
        run, ref = results[(strategy, kind, "32-true")], results[("ddp", kind, "32-true")]
        assert_parity(run, ref)
        assert len(run["val_losses"]) == len(ref["val_losses"]) > 0
        # EMA validates with the average swapped in and swaps back: validation and what follows match DDP
        assert loss_err(run["val_losses"], ref["val_losses"]) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", BF16)
def test_averaging_under_bf16(world2, strategy, kind):
    for results in world2:
        assert_16bit_close(results[(strategy, kind, "bf16-mixed")], results[("ddp", kind, "bf16-mixed")],
                           results[("ddp", kind, "32-true")])


def test_the_averaged_weights_differ_from_training_without_averaging(world2):
    # what the parity tests compare is the average: without the callback the same training ends elsewhere
    for results in world2:
        plain = results[("ddp", "none", "32-true")]["state"]
        for kind in KINDS:
            averaged = results[("ddp", kind, "32-true")]["state"]
            assert max((averaged[k] - plain[k]).abs().max().item() for k in plain) > 1e-3, kind


RESUMED = [("zero1", "zero1", "sharded"), ("zero2", "zero2", "sharded"), ("zero3_sharded", "zero3_sharded", "sharded"),
           ("zero2", "zero3_sharded", "sharded"), ("zero3_sharded", "zero1", "sharded"),
           ("zero2", "zero2", "full"), ("zero3_sharded", "zero3_sharded", "full")]


@pytest.mark.slow
def test_ema_checkpoint_resumes_as_under_ddp(tmp_path_factory):
    # EMA saves the average as the state dict and the module's own weights beside it; a resume restores both
    root = str(tmp_path_factory.mktemp("ema"))
    per_rank = run_ranks(run_ema_resumed, 2, [("ddp", "ddp", "full"), *RESUMED], root, lightning=True)
    for results in per_rank:
        ref = results[("ddp", "ddp", "full")]
        assert len(ref["losses"]) > 0
        for run in RESUMED:
            assert_parity(results[run], ref)
            assert loss_err(results[run]["val_losses"], ref["val_losses"]) <= 1e-5, run
    # the consolidation tool keeps both: the file a DDP run resumes from holds what DDP itself saved
    ddp = torch.load(f"{root}/ddp_ddp_full/last.ckpt", weights_only=False)
    for saver in ("zero2", "zero3_sharded"):
        out = f"{root}/{saver}.ckpt"
        write_checkpoint(f"{root}/{saver}_{saver}_sharded/last.ckpt", out)
        mine = torch.load(out, weights_only=False)
        for top in ("state_dict", "current_model_state"):
            assert mine[top].keys() == ddp[top].keys()
            assert max((mine[top][k] - ddp[top][k]).abs().max().item() for k in ddp[top]) <= 1e-5, (saver, top)
