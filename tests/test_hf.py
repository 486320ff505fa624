"""Hugging Face GPT-2: both examples on 2 CPU ranks, save_pretrained -> from_pretrained, and HF's
reentrant gradient checkpointing under every stage against DDP."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_utils import job_env, run_ranks  # noqa: E402
from parity import assert_parity  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STAGES = (1, 2, 3)


def _all(rank: int, world: int) -> dict:
    from hf_cases import ddp_reference, engine_run

    return {"ddp": ddp_reference(rank, world), **{f"zero{s}": engine_run(rank, world, s) for s in STAGES}}


@pytest.fixture(scope="module")
def world2():
    return run_ranks(_all, 2)


@pytest.mark.parametrize("stage", STAGES)
def test_reentrant_checkpointing_matches_ddp(world2, stage: int) -> None:
    # HF's gradient_checkpointing_enable(use_reentrant=True) re-runs each block's forward inside
    # backward: stage 3 re-gathers its parameters there; the result equals DDP without recomputation
    for r in world2:
        run, ref = r[f"zero{stage}"], r["ddp"]
        assert run["steps"] == 4
        assert_parity(run, ref)
        assert run["tied"]  # lm_head still shares wte's parameter
        assert torch.equal(run["state"]["lm_head.weight"], run["state"]["transformer.wte.weight"])


def _checked_save(out: subprocess.CompletedProcess, saved: Path) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    losses = [float(x) for x in re.findall(r"epoch \d+ loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0], losses
    printed = float(re.search(r"checksum (-?[0-9.]+)", out.stdout).group(1))
    # loaded by plain transformers, without lightning_zero
    model = transformers.GPT2LMHeadModel.from_pretrained(saved)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert abs(sum(float(p.detach().double().sum()) for p in model.parameters()) - printed) < 1e-3


def _env() -> dict:
    return job_env(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def test_engine_example_on_two_cpu_ranks(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          str(EXAMPLES / "hf_gpt2_engine.py"), "--tiny", "--epochs", "2", "--out",
                          str(tmp_path / "saved")], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=300)
    _checked_save(out, tmp_path / "saved")


def test_lightning_example_zero3_reentrant_checkpointing(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(EXAMPLES / "hf_gpt2_lightning.py"), "tiny=true", "epochs=2",
                          "checkpointing=true", "accelerator=cpu", f"out={tmp_path / 'saved'}",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=_env(), capture_output=True,
                         text=True, timeout=300)
    _checked_save(out, tmp_path / "saved")
