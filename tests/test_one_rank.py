"""Events on one rank only never desynchronize or hang a job (tests/one_rank_job.py, started as users
start it, with Lightning launching the second rank): an fp16 overflow on one rank is skipped by every
rank; a rank-0-only callback may read state; an error or a collective on rank 0 only ends the job with
a clear error on every rank instead of a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_utils import job_env

JOB = Path(__file__).parent / "one_rank_job.py"
STRATEGIES = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")


def run_job(out: Path, scenario: str, strategy: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
    env = job_env(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(JOB), str(out), scenario, strategy], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=out)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is gone too
        return f.read().split()[2] == "Z"


def wait_gone(out: Path, within: float) -> list[int]:
    pids = [int((out / f"rank{r}.pid").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if not gone(p)]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_overflow_on_one_rank_is_skipped_everywhere_while_rank0_reads_state(tmp_path, strategy):
    job = run_job(tmp_path, "overflow", strategy)
    assert job.returncode == 0, job.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["steps"] == r1["steps"] == 6
    # trace[i] is after step i: steps 2 and 3 (rank 1's infinite loss) changed nothing on either rank
    assert r0["changed"] == r1["changed"] == [True, False, False, True, True]
    assert r0["scale"] == r1["scale"] == 2.0**8 / 4  # halved at each overflow (hysteresis 1)
    assert r0["reads"] == 6 and r1["reads"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("scenario,message", [("sharded", "lightning_module_state_dict()"), ("collective", "full_state_dict()")])
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_an_error_on_rank0_only_ends_every_rank(tmp_path, scenario, message, strategy):
    job = run_job(tmp_path, scenario, strategy)
    assert job.returncode != 0
    assert message in job.stderr, job.stderr[-3000:]
    assert not wait_gone(tmp_path, within=60.0), "a rank is still running after rank 0 failed"
    assert not (tmp_path / "rank1.pt").exists()
