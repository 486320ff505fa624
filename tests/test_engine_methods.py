"""The engine behaves as DeepSpeed's: an nn.Module with DeepSpeed's methods and semantics, plus ``zero.Init``
and ``zero.GatheredParameters`` (2 gloo ranks; references by hand or from a plain torch model)."""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import run_ranks
from engine_methods_cases import gathered_case, methods_case, zero_init_case

# as DeepSpeed: the engine takes the accelerator when there is one (the GPU checks run these files there)
EXPECTED_DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_methods(tmp_path, stage):
    results = run_ranks(methods_case, 2, stage, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["is_module"] and r["module_is_model"] and r["loader"] is None and r["sched"] is None
        assert (r["rank"], r["world"], r["local_rank"], r["device"]) == (rank, 2, 0, EXPECTED_DEVICE)
        assert (r["fp16"], r["bf16"], r["stage"]) == (False, False, stage)
        assert (r["gas"], r["mbs"], r["tbs"]) == (2, 4, 16)
        assert r["names"] == ["module.a.weight", "module.a.bias", "module.norm.weight", "module.norm.bias",
                              "module.b.weight", "module.b.bias"] and r["n_params"] == 6
        assert r["eval_mode"] == (False, False) and r["train_mode"] == (True, True)
        assert r["boundaries"] == [False, True, False, True] and r["backward_returns_loss"]
        assert r["norm_before"] is None
        assert r["partitions"] == (stage >= 2, stage == 3, False, False) and r["fp16_saver"]
        assert r["mom"] == [0.0] and r["training_dataloader"] is None  # SGD without momentum; no training_data
        # DeepSpeed's global norm is the norm before clipping, over every rank's gradient
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5) and all(n > 0.5 for n in r["norms"])
        assert r["global_steps"] == 2 and r["skipped"] == 0 and r["lr"] == [0.1]
        assert not any(r["grads_after_step"]) and r["no_sync_ok"]
        assert r["no_latest"] == (None, None) and r["no_latest_warned"]
        assert "no_such_tag" in r["missing_tag"] and "does not exist" in r["missing_tag"]
        assert r["latest"] == "mytag" and r["loaded"] == ("mytag", {"k": 0})  # rank 0's client state, as DeepSpeed
    assert results[0]["max_err"] < 1e-6 and results[0]["saved_16bit"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_zero_init_builds_the_same_model_sharded(stage):
    for r in run_ranks(zero_init_case, 2, stage):
        assert r["meta"] and "meta device" in r["meta_gather"] and not r["meta_left"]
        assert r["max_err"] == 0.0  # the same values as a normal build with the same seed
        assert r["held"] <= math.ceil(r["total"] / 2) * 1.02  # each rank's master: its half (plus padding)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_gathered_parameters_read_and_modify(stage):
    for r in run_ranks(gathered_case, 2, stage):
        assert r["read"] and r["discarded"] and r["modified"]
        assert r["forward_err"] < 1e-6
        assert r["shape_outside"] == (4,)


PLAIN = """
import sys, torch, lightning_zero as deepspeed
from torch import nn
torch.manual_seed(0)
m = nn.Linear(4, 2)
e, o, _, _ = deepspeed.initialize(model=m, config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                                                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
for i in range(3):
    e.backward(e(torch.randn(2, 4, device=e.device)).sum())
    e.step()
e.save_checkpoint(sys.argv[1], client_state={"a": 1})
before = e.full_state_dict()
print(e.load_checkpoint(sys.argv[1]), e.world_size, all(torch.equal(before[k], v) for k, v in e.full_state_dict().items()))
"""


def test_plain_process_trains_saves_and_loads(tmp_path):
    """No torchrun, no process group: as DeepSpeed, the engine runs as a group of one, checkpoints included."""
    import subprocess
    import sys

    from dist_utils import job_env

    out = subprocess.run([sys.executable, "-c", PLAIN, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env=job_env(PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == f"('{tmp_path}/global_step3', {{'a': 1}}) 1 True"


def test_get_accelerator_answers_as_deepspeeds_does():
    import lightning_zero as deepspeed

    acc = deepspeed.accelerator.get_accelerator()
    cuda = torch.cuda.is_available()
    assert acc is deepspeed.accelerator.get_accelerator()
    assert acc.device_name() == ("cuda" if cuda else "cpu") and acc.communication_backend_name() == (
        "nccl" if cuda else "gloo")
    assert torch.zeros(1, device=acc.current_device_name()).device.type == acc.device_name()
    assert acc.on_accelerator(torch.zeros(1, device=acc.device_name())) and acc.device_count() >= 1
    acc.manual_seed(3)
    first = torch.rand(2)
    acc.manual_seed(3)
    assert torch.equal(first, torch.rand(2))
    with pytest.raises(AttributeError, match="not provided by lightning_zero.accelerator"):
        getattr(acc, "lazy_call")  # noqa: B009 - the attribute access is the test


@pytest.mark.parametrize("stage,offload", [(1, False), (2, False), (3, False), (2, True), (3, True)])
def test_safe_get_full_values_equal_the_plain_model(stage, offload):
    """deepspeed.utils.safe_get_full_grad / _fp32_param / _optimizer_state / safe_set_full_fp32_param (collectives)
    on 2 ranks against plain AdamW fed both ranks' batches."""
    from engine_methods_cases import full_values_case

    for r in run_ranks(full_values_case, 2, stage, offload):
        assert r["shapes_ok"] and r["set_ok"] and r["no_grad_after_step"]
        assert max(r["errors"].values()) < 1e-5, r["errors"]


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_checkpointing_recomputes_the_same_training(stage):
    from engine_methods_cases import checkpointing_case

    for r in run_ranks(checkpointing_case, 2, stage):
        assert r["max_diff"] < 1e-6, r


def test_deepspeed_checkpointing_configure_refuses_what_it_cannot_do():
    import lightning_zero as deepspeed

    deepspeed.checkpointing.configure(None, num_checkpoints=4, synchronize=False)
    assert deepspeed.checkpointing.is_configured()
    with pytest.raises(ValueError, match="partition_activations=True.*leave them off"):
        deepspeed.checkpointing.configure(None, partition_activations=True)
    with pytest.raises(ValueError, match="no model parallelism"):
        deepspeed.checkpointing.configure(object())
