"""The engine behaves as DeepSpeed's: an nn.Module with DeepSpeed's methods and semantics, plus ``zero.Init``
and ``zero.GatheredParameters`` (2 gloo ranks; references by hand or from a plain torch model)."""

from __future__ import annotations

import math

import pytest
from dist_utils import run_ranks
from engine_methods_cases import gathered_case, methods_case, zero_init_case


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_methods(tmp_path, stage):
    results = run_ranks(methods_case, 2, stage, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["is_module"] and r["module_is_model"] and r["loader"] is None and r["sched"] is None
        assert (r["rank"], r["world"], r["local_rank"], r["device"]) == (rank, 2, 0, "cpu")
        assert (r["fp16"], r["bf16"], r["stage"]) == (False, False, stage)
        assert (r["gas"], r["mbs"], r["tbs"]) == (2, 4, 16)
        assert r["names"] == ["module.a.weight", "module.a.bias", "module.norm.weight", "module.norm.bias",
                              "module.b.weight", "module.b.bias"] and r["n_params"] == 6
        assert r["eval_mode"] == (False, False) and r["train_mode"] == (True, True)
        assert r["boundaries"] == [False, True, False, True] and r["backward_returns_loss"]
        assert r["norm_before"] is None
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
