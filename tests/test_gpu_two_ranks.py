"""World 2 on one GPU (gloo): zero1/2/3 against DDP on the same two ranks, with the models of
test_every_model, fp32 / bf16 / fp16, accumulation, prefetch, overlap off and evaluation."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_ranks
from parity import assert_16bit_close, assert_parity, global_l2_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
REF = "ddp_find_unused_parameters_true"
KINDS = ("plain", "lora", "unused", "stem", "moe")
STAGES = ("zero1", "zero2", "zero3")
VARIANTS = {
    "fp32": {},
    "accumulate": dict(accumulate=2),
    "bf16": dict(precision="bf16-mixed"),
    "fp16": dict(precision="16-mixed"),
}


def _runs() -> dict:
    runs = {}
    for kind in KINDS:
        runs[(kind, REF, "fp32")] = ((kind, REF), {})
        for stage in STAGES:
            runs[(kind, stage, "fp32")] = ((kind, stage), {})
    for variant in ("accumulate", "bf16", "fp16"):
        runs[("plain", REF, variant)] = (("plain", REF), VARIANTS[variant])
        for stage in STAGES:
            options = dict(VARIANTS[variant])
            if variant == "fp16":  # ZeroPrecision: fp16 with dynamic loss scaling, as Lightning's GradScaler
                options = dict(plugin="16-mixed")
            runs[("plain", stage, variant)] = (("plain", stage), options)
    runs[("stem", "zero3", "prefetch2")] = (("stem", "zero3"), dict(options=dict(prefetch=2)))
    runs[("stem", "zero3", "no_overlap")] = (("stem", "zero3"), dict(options=dict(overlap_comm=False)))
    runs[("stem", "zero2", "no_overlap")] = (("stem", "zero2"), dict(options=dict(overlap_comm=False)))
    for key, (args, kwargs) in OFFLOAD.items():
        runs[key] = (args, kwargs)
    runs[("plain", "zero_auto", "fp32")] = (("plain", "zero_auto"), {})
    return runs


# Offload on the GPU: pinned host arenas, device->host gradient copies on the side stream, host steps
# with the fused CPU kernel, host->device gathers on the side stream (stage 3), NVMe staging.
_CPU = dict(offload_optimizer="cpu")
_NVME = dict(offload_optimizer="nvme", offload_params="nvme", nvme_path="/tmp", nvme_buffer_bytes=64 << 20)
OFFLOAD = {
    ("plain", "zero2", "offload"): (("plain", "zero2"), dict(options=_CPU)),
    ("plain", "zero1", "offload"): (("plain", "zero1"), dict(options=_CPU)),
    ("plain", "zero3", "offload"): (("plain", "zero3"), dict(options=dict(_CPU, offload_params="cpu"))),
    ("moe", "zero2", "offload"): (("moe", "zero2"), dict(options=dict(_CPU, offload_fraction=0.5))),
    ("lora", "zero3", "offload"): (("lora", "zero3"), dict(options=dict(_CPU, offload_fraction=0.5))),
    ("plain", "zero3", "offload_nvme"): (("plain", "zero3"), dict(options=_NVME)),
    ("plain", "zero2", "offload_accumulate"): (("plain", "zero2"), dict(accumulate=2, options=_CPU)),
    ("plain", "zero3", "offload_bf16"): (("plain", "zero3"), dict(precision="bf16-mixed",
                                                                   options=dict(_CPU, offload_params="cpu"))),
    ("plain", "zero2", "offload_fp16"): (("plain", "zero2"), dict(plugin="16-mixed", options=_CPU)),
}


@pytest.fixture(scope="module")
def results():
    from gpu_cases import gpu_zoo_many

    return run_ranks(gpu_zoo_many, 2, _runs(), one_gpu=True, timeout=600)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stage", STAGES)
def test_fp32_two_ranks_one_gpu_match_ddp(results, kind, stage):
    for rank in results:
        run, ref = rank[(kind, stage, "fp32")], rank[(kind, REF, "fp32")]
        assert run["device_count"] >= 1 and run["global_step"] == ref["global_step"] > 0
        assert_parity(run, ref)
        assert abs(run["val"]["val_loss"] - ref["val"]["val_loss"]) < 1e-5


@pytest.mark.parametrize("stage", STAGES)
def test_accumulation_two_ranks_one_gpu(results, stage):
    for rank in results:
        assert_parity(rank[("plain", stage, "accumulate")], rank[("plain", REF, "accumulate")])


@pytest.mark.parametrize("mode,stage", [("prefetch2", "zero3"), ("no_overlap", "zero3"), ("no_overlap", "zero2")])
def test_prefetch_and_overlap_off_two_ranks_one_gpu(results, mode, stage):
    for rank in results:
        assert_parity(rank[("stem", stage, mode)], rank[("stem", REF, "fp32")])


@pytest.mark.parametrize("variant", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", STAGES)
def test_16bit_two_ranks_one_gpu_close_to_ddp(results, variant, stage):
    # 16-bit parameters and gradients in the module (DDP's autocast keeps fp32 ones): close, not equal
    for rank in results:
        run, ref = rank[("plain", stage, variant)], rank[("plain", REF, variant)]
        assert run["global_step"] == ref["global_step"] > 0
        assert_16bit_close(run, ref, rank[("plain", REF, "fp32")])  # see parity.SIXTEEN_BIT_FACTOR


@pytest.mark.parametrize("key", [k for k in OFFLOAD if k[2] in ("offload", "offload_nvme")])
def test_offload_two_ranks_one_gpu_match_ddp(results, key):
    for rank in results:
        assert_parity(rank[key], rank[(key[0], REF, "fp32")])


def test_offload_accumulation_two_ranks_one_gpu(results):
    for rank in results:
        assert_parity(rank[("plain", "zero2", "offload_accumulate")], rank[("plain", REF, "accumulate")])


@pytest.mark.parametrize("key,ref", [(("plain", "zero3", "offload_bf16"), ("plain", "zero3", "bf16")),
                                     (("plain", "zero2", "offload_fp16"), ("plain", "zero2", "fp16"))])
def test_16bit_offload_same_as_on_device(results, key, ref):
    # the host steps the same fp32 master from the same 16-bit gradients; the fused CPU kernel rounds
    # differently from the CUDA one and a 16-bit parameter flips an ulp now and then (measured 3.2e-5)
    for rank in results:
        assert global_l2_err(rank[key]["state"], rank[ref]["state"]) < 1e-4


def test_zero_auto_two_ranks_one_gpu_measures_together_and_matches_ddp(results):
    # each rank reads its CUDA peak in the first step; both plan with the same (largest) figure
    figures = [rank[("plain", "zero_auto", "fp32")]["measured"] for rank in results]
    assert figures[0] is not None and figures[0] > 0 and len(set(figures)) == 1, figures
    for rank in results:
        assert_parity(rank[("plain", "zero_auto", "fp32")], rank[("plain", REF, "fp32")])
