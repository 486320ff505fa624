"""GPU checks (NCCL, CUDA streams): skipped without CUDA; run on the GPU machine."""

from __future__ import annotations

import pytest
import torch
from lightning_cases import fit_case
from parity import assert_parity, global_l2_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LM = dict(accumulate=2, clip_val=0.5, accelerator="gpu")


@pytest.fixture(scope="module")
def reference():
    return fit_case(0, 1, "lm", "auto", **LM)


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_nccl_fp32_matches_single_device(reference, strategy):
    torch.backends.cuda.matmul.allow_tf32 = False
    run = fit_case(0, 1, "lm", strategy, **LM)
    assert_parity(run, reference, tol=1e-5)
    assert run["dtype"] == "torch.float32"


def test_nccl_bf16_close_to_autocast():
    ref = fit_case(0, 1, "lm", "auto", precision="bf16-mixed", **LM)
    run = fit_case(0, 1, "lm", "zero2", precision="bf16-mixed", **LM)
    assert global_l2_err(run["state"], ref["state"]) < 1e-2


def test_fp16_loss_scaling_on_gpu():
    run = fit_case(0, 1, "lm", "zero2", precision="16-mixed", accelerator="gpu", epochs=1)
    assert all(torch.isfinite(v).all() for v in run["state"].values())
