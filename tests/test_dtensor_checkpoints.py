"""The sharded state as DTensors, and checkpoints that move between ZeroStrategy, FSDP2 and plain PyTorch.

Round trips: ZeRO stages 1-3 on 2 ranks -> Lightning's ModelParallelStrategy (FSDP2 ``fully_shard``) on 1 and 4
ranks, and FSDP2 on 2 ranks -> every stage on 1, 2 and 4 ranks; the first-format (v1) fixture into today's
code; ``dcp_to_torch_save`` into a bare module. Each resumed run must equal the uninterrupted run (1e-5, fp32:
see dtensor_cases.py).
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import dtensor_cases as cases
import pytest
import torch
from checkpoint_cases import FIRST, TOTAL, StepLM
from dist_utils import run_ranks
from parity import state_err
from test_checkpoint import assert_resumed_like

from lightning_zero.checkpoint.export import write_weights

FIXTURE = Path(__file__).parent / "fixtures" / "sharded_v1.tar.gz"


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dtensor"))


@pytest.fixture(scope="module")
def written(ckpt_dir):
    return run_ranks(cases.writers, 2, ckpt_dir, lightning=True, timeout=900)


@pytest.fixture(scope="module")
def read_one(written, ckpt_dir):
    return run_ranks(cases.readers_one, 1, ckpt_dir, lightning=True, timeout=900)[0]


@pytest.fixture(scope="module")
def read_four(written, ckpt_dir):
    return run_ranks(cases.readers_four, 4, ckpt_dir, lightning=True, timeout=900)


@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_returned_state_is_dtensors_that_behave_as_torch_documents(tmp_path, stage):
    for rank, r in enumerate(run_ranks(cases.dtensor_case, 2, str(tmp_path), stage, lightning=True, timeout=600)):
        assert set(r["types"].values()) == {"DTensor"}  # every parameter (frozen ones too: the engine holds them)
        assert max(r["errors"].values()) == 0.0  # full_tensor() and elementwise math equal the gathered values
        assert max(r["opt_errors"].values()) == 0.0  # exp_avg / exp_avg_sq / step as full_optimizer_state_dict
        assert r["tied_same_object"]
        assert r["group_params"][0][0] == "emb.weight"  # param groups name their parameters
        # stage 1 (fp32): each rank's DTensor is the whole parameter (Replicate); stage 3: torch.chunk rows
        assert r["whole"] == (stage == "zero1")
        # a callback that sees the checkpoint dict is told, at setup, when the values there are row chunks
        assert r["sharded_view_warned"] == (stage == "zero3" and rank == 0)
        assert r["local"]["emb.weight"] in (((37, 24),) if stage == "zero1" else ((19, 24), (18, 24)))
        assert r["save_warnings"] == []  # no deprecation warning (no ShardedTensor) from a save


def test_a_callback_uses_the_checkpoint_dtensors_on_one_rank(tmp_path):
    # rank 0 alone, in on_save_checkpoint, does local math on the DTensors: no hang, real values
    results = run_ranks(cases.dtensor_case, 2, str(tmp_path), "zero2", lightning=True, timeout=600)
    seen = results[0]["one_rank"]
    assert seen["type"] == "DTensor" and seen["moment_type"] == "DTensor" and seen["moment_shape"] == (48, 24)
    assert seen["local_sum"] != 0.0
    # a norm read on one rank is the parameter's own, as under DDP (of Shard(0) it would be rank 0's part)
    assert seen["placements"] == "(Replicate(),)"
    assert abs(seen["norm"] - results[0]["true_norm"]) <= 1e-6 * results[0]["true_norm"]
    assert results[1]["one_rank"] is None


def test_fsdp2_and_zero_train_alike(written):
    # the premise of the round trips: uninterrupted FSDP2 and ZeRO runs agree
    assert state_err(written[0]["fsdp_ref"]["state"], written[0]["ref"]["state"]) <= 1e-5


def test_zero_checkpoints_resume_under_fsdp2(written, read_one, read_four):
    ref = written[0]["ref"]
    assert_resumed_like(read_one["fsdp_from_zero1"], ref)  # 2 ranks -> 1
    assert_resumed_like(read_one["fsdp_from_zero2"], ref)
    for r in read_four:  # 2 ranks (stage 3) -> 4
        assert_resumed_like(r["fsdp_from_zero3"], ref)


def test_fsdp2_checkpoints_resume_under_every_stage(written, read_one, read_four):
    ref = written[0]["ref"]
    for r in written:
        assert_resumed_like(r["zero2_from_fsdp"], ref)  # same world size
    assert_resumed_like(read_one["zero1_from_fsdp"], ref)
    assert_resumed_like(read_one["zero3_from_fsdp"], ref)
    for r in read_four:
        assert_resumed_like(r["zero2_from_fsdp"], ref)
        assert_resumed_like(r["zero3_from_fsdp"], ref)


def test_first_format_checkpoints_still_load(tmp_path, written):
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    ref = written[0]["ref"]
    for world in (1, 2):
        for r in run_ranks(cases.old_format, world, str(tmp_path), lightning=True, timeout=900):
            assert_resumed_like(r["zero1_from_v1_zero2"], ref)
            assert_resumed_like(r["zero3_from_v1_zero3"], ref)
    write_weights(tmp_path / "zero2.ckpt", tmp_path / "v1.pt")  # the consolidate tool reads it too
    StepLM().load_state_dict(torch.load(tmp_path / "v1.pt", weights_only=True), strict=True)


@pytest.mark.parametrize("name", ["zero1", "zero3", "fsdp"])
def test_dcp_to_torch_save_gives_a_file_the_bare_module_loads(written, ckpt_dir, tmp_path, name):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(f"{ckpt_dir}/{name}.ckpt", tmp_path / "plain.pt")
    saved = torch.load(tmp_path / "plain.pt", weights_only=False)
    module = StepLM()
    module.load_state_dict(saved["state_dict"], strict=True)
    # the weights at step FIRST: the same whichever strategy wrote them; equal to the consolidate tool's
    write_weights(f"{ckpt_dir}/{name}.ckpt", tmp_path / "weights.pt")
    consolidated = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert state_err(dict(module.state_dict()), consolidated) == 0.0
    assert saved["optimizer_0"]["state"]["fc1.weight"]["exp_avg"].shape == (48, 24)
    assert saved["optimizer_0"]["param_groups"][0]["params"][0] == "emb.weight"
    if name != "zero1":
        zero1 = torch.load(_plain(ckpt_dir, "zero1", tmp_path), weights_only=False)["state_dict"]
        assert state_err(saved["state_dict"], zero1) <= 1e-5


def _plain(ckpt_dir: str, name: str, tmp_path: Path) -> Path:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{name}_plain.pt"
    dcp_to_torch_save(f"{ckpt_dir}/{name}.ckpt", out)
    return out


def test_load_from_checkpoint_reads_fsdp2_directories(written, ckpt_dir):
    module = StepLM.load_from_checkpoint(f"{ckpt_dir}/fsdp.ckpt")
    zero1 = StepLM.load_from_checkpoint(f"{ckpt_dir}/zero1.ckpt")
    assert state_err(dict(module.state_dict()), dict(zero1.state_dict())) <= 1e-5
    assert FIRST < TOTAL


@pytest.mark.parametrize("stage,precision", [("zero1", "32-true"), ("zero3", "32-true"), ("zero2", "bf16-mixed")])
def test_torch_state_dict_functions_on_a_trained_module(stage, precision):
    for r in run_ranks(cases.state_dict_api_case, 2, stage, precision, lightning=True, timeout=600):
        # get_model_state_dict reads the module's compute copies: exact in fp32, rounded under bf16-mixed
        assert r["get_dtype"] == ("torch.float32" if precision == "32-true" else "torch.bfloat16")
        assert r["get_err"] <= (0.0 if precision == "32-true" else 2e-2)
        # set_model_state_dict / load_state_dict write the fp32 masters, plain tensors and DTensors alike
        assert r["set_err"] <= 1e-6 and r["dtensor_load_err"] <= 1e-6
        assert "lightning_module_state_dict" in r["optimizer"] or "optimizer_state" in r["optimizer"], r["optimizer"]
