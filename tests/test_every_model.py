"""The models people train (LoRA-style, unused layers, out-of-order stems, MoE) under every stage:
DDP's numbers, and bounded memory measured from hooks inside the user's model."""

from __future__ import annotations

import pytest
from dist_utils import run_ranks
from model_zoo import LAYERS, fit_zoo_many
from parity import assert_parity

KINDS = ("plain", "lora", "unused", "stem", "moe")
STAGES = ("zero1", "zero2", "zero3")


def _parity_runs() -> dict:
    runs = {}
    for kind in KINDS:
        runs[(kind, "ddp", 1)] = ((kind, "ddp_find_unused_parameters_true"), {})
        for stage in STAGES:
            runs[(kind, stage, 1)] = ((kind, stage), {})
    runs[("moe", "ddp", 2)] = (("moe", "ddp_find_unused_parameters_true"), dict(accumulate=2))
    for stage in STAGES:
        runs[("moe", stage, 2)] = (("moe", stage), dict(accumulate=2))
    return runs


# bf16 reduce dtype: the fp32 unit-sized buffers alive are gathered parameters, the bf16 ones gradients
PROBE = dict(probe=True, options=dict(reduce_dtype="bf16"))
NO_OVERLAP = dict(probe=True, options=dict(reduce_dtype="bf16", overlap_comm=False))


def _probe_runs() -> dict:
    runs = {(kind, stage, "overlap"): ((kind, stage), PROBE) for kind in KINDS for stage in ("zero2", "zero3")}
    for stage in ("zero2", "zero3"):
        runs[("plain", stage, "no_overlap")] = (("plain", stage), NO_OVERLAP)
    return runs


@pytest.fixture(scope="module")
def parity():
    return run_ranks(fit_zoo_many, 2, _parity_runs(), lightning=True)


@pytest.fixture(scope="module")
def probes():
    return run_ranks(fit_zoo_many, 2, _probe_runs(), lightning=True, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stage", STAGES)
def test_matches_ddp_with_unused_parameters(parity, kind, stage):
    # AdamW with weight decay: a parameter no rank used must not move (DDP leaves it alone)
    for results in parity:
        assert results[(kind, stage, 1)]["global_step"] == results[(kind, "ddp", 1)]["global_step"] > 0
        assert_parity(results[(kind, stage, 1)], results[(kind, "ddp", 1)])


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_moe_with_accumulation_matches_ddp(parity, stage):
    for results in parity:
        assert_parity(results[("moe", stage, 2)], results[("moe", "ddp", 2)])


def test_idle_expert_and_unused_layer_never_move(parity):
    for results in parity:
        for stage in STAGES:
            moe_before = results[("moe", stage, 1)]["state"]
            # expert 3 is never chosen: its weights equal DDP's, which never stepped them
            assert (moe_before["moe.experts.3.weight"] == results[("moe", "ddp", 1)]["state"]["moe.experts.3.weight"]).all()
            unused = results[("unused", stage, 1)]["state"]
            assert (unused["blocks.3.fc1.weight"] == results[("unused", "ddp", 1)]["state"]["blocks.3.fc1.weight"]).all()


def _max(run: dict, dtype: str) -> int:
    return max(counts.get(dtype, 0) for counts in run["seen_buffers"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_stage3_gathers_at_most_prefetch_plus_two_groups(probes, kind):
    prefetch = 1
    for results in probes:
        for mode in ("overlap", "no_overlap"):
            run = results.get((kind, "zero3", mode))
            if run is None:
                continue
            assert run["seen_buffers"], "the probes inside the model never ran"
            # gathered block groups (their fp32 flat buffers alive), at every hook of forward and backward; a
            # LoRA block is two units (frozen base, trainable adapters: see ZeroEngine._plans), same bytes
            units_per_group = 2 if kind == "lora" else 1
            assert _max(run, "float32") <= (prefetch + 2) * units_per_group, (kind, mode, run["seen_buffers"])
            assert max(run["seen_blocks"]) <= 2  # blocks whose parameters point at memory
            assert _max(run, "bfloat16") <= 3  # and the bounded gradient buffers


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_stage2_holds_at_most_two_gradient_buckets_beyond_the_filling_one(probes, kind):
    for results in probes:
        for mode in ("overlap", "no_overlap"):
            run = results.get((kind, "zero2", mode))
            if run is None:
                continue
            assert _max(run, "bfloat16") <= 3, (kind, mode, run["seen_buffers"])
            assert _max(run, "float32") >= LAYERS  # stage 2 keeps its parameters: the probe does see buffers


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_report_matches_live_storages(stage):
    # what the report calls model state, against every live CPU tensor storage gc finds in the
    # process at the same moment (the rest of the process holds a few KiB: data, RNG, metrics)
    from model_zoo import live_bytes_case

    for rank in run_ranks(live_bytes_case, 2, stage, lightning=True):
        assert rank["seen"], "the probe never ran"
        for seen in rank["seen"]:
            report = seen["report"]
            alive = report["model_state_bytes"] + report["comm_buffers_bytes"]
            assert report["gradients_bytes"] > 0 and report["optimizer_state_bytes"] > 0
            assert alive <= seen["live"] <= alive * 1.03 + 16384, (seen["live"], report)
