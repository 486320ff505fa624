"""On the GPU: ZeRO checkpoints (two ranks sharing the GPU over gloo) resume under FSDP2 (one rank, NCCL) and
the reverse; each resumed run equals the uninterrupted one (fp32). See tests/test_dtensor_checkpoints.py."""

from __future__ import annotations

import dtensor_cases as cases
import pytest
import torch
from dist_utils import run_ranks
from test_checkpoint import assert_resumed_like

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("gpu_dtensor"))
    written = run_ranks(cases.gpu_zero_writers, 2, d, one_gpu=True, timeout=600)
    fsdp = run_ranks(cases.gpu_fsdp, 1, d, lightning=True, timeout=600)[0]
    read = run_ranks(cases.gpu_zero_readers, 2, d, one_gpu=True, timeout=600)
    return written, fsdp, read


def test_zero_checkpoints_resume_under_fsdp2_on_the_gpu(runs):
    written, fsdp, _ = runs
    assert_resumed_like(fsdp["fsdp_from_zero2"], written[0]["ref"])
    assert_resumed_like(fsdp["fsdp_from_zero3"], written[0]["ref"])


def test_fsdp2_checkpoints_resume_under_zero_on_the_gpu(runs):
    written, _, read = runs
    for r in read:
        assert_resumed_like(r["zero2_from_fsdp"], written[0]["ref"])
        assert_resumed_like(r["zero3_from_fsdp"], written[0]["ref"])


def test_dtensor_state_on_the_gpu(tmp_path):
    for r in run_ranks(cases.dtensor_case, 2, str(tmp_path), "zero3", "gpu", 2, one_gpu=True, timeout=600):
        assert set(r["types"].values()) == {"DTensor"}
        assert max(r["errors"].values()) == 0.0 and max(r["opt_errors"].values()) == 0.0
        assert r["save_warnings"] == []
