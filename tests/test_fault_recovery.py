"""Fault recovery under ``torchrun --max-restarts 1``: a rank dies, the job restarts and resumes
from the last complete sharded checkpoint, and ends with the weights of an uninterrupted run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import free_port, job_env
from parity import state_err

from lightning_zero.checkpoint.files import check_complete

JOB = Path(__file__).parent / "fault_job.py"


def start_job(out: Path, strategy: str, kill: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.5", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           str(JOB), str(out), strategy, kill]
    env = job_env(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


JOBS = {"reference": ("zero2", "none"), "zero2": ("zero2", "step"), "zero3": ("zero3", "step"),
        "save": ("zero2", "save")}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every job at once (each is mostly process start-up and restarts): name -> (directory, finished job)."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in JOBS}
    procs = {name: start_job(dirs[name], *JOBS[name]) for name in JOBS}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = (dirs[name], subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return out


@pytest.fixture(scope="module")
def reference(jobs):
    out, job = jobs["reference"]
    assert job.returncode == 0, job.stderr[-3000:]
    return torch.load(out / "final.pt", weights_only=False)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_rank_killed_between_checkpoints_resumes_exactly(jobs, reference, strategy):
    tmp_path, job = jobs[strategy]
    assert job.returncode == 0, job.stderr[-3000:]
    final = torch.load(tmp_path / "final.pt", weights_only=False)
    assert final["attempt"] == 1  # the job was restarted once
    assert "last.ckpt" in torch.load(tmp_path / "attempt1_saw.pt")
    assert final["seen_steps"] == list(range(4, 9))  # resumed from the step-4 checkpoint
    assert final["global_step"] == reference["global_step"] == 9
    assert state_err(final["state"], reference["state"]) <= 1e-5


def test_rank_killed_while_saving_leaves_last_complete_checkpoint(jobs, reference):
    tmp_path, job = jobs["save"]
    assert job.returncode == 0, job.stderr[-3000:]
    saw = torch.load(tmp_path / "attempt1_saw.pt")
    # the cut save is only a ".partial" directory; "last" is still the complete step-4 checkpoint
    assert "epoch=0-step=6.ckpt.partial" in saw and "epoch=0-step=6.ckpt" not in saw, saw
    final = torch.load(tmp_path / "final.pt", weights_only=False)
    assert final["attempt"] == 1 and final["seen_steps"] == list(range(4, 9))
    assert state_err(final["state"], reference["state"]) <= 1e-5
    ckpts = tmp_path / "checkpoints"
    assert not any(p.name.endswith(".partial") for p in ckpts.iterdir())  # the next save replaced it
    for name in ("epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"):
        check_complete(ckpts / name)
