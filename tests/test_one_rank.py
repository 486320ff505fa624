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


def start_job(out: Path, scenario: str, strategy: str) -> subprocess.Popen:
    env = job_env(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(JOB), str(out), scenario, strategy], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=out)


def finish(proc: subprocess.Popen, timeout: float = 180.0) -> subprocess.CompletedProcess:
    stdout, stderr = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_job(out: Path, scenario: str, strategy: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
    return finish(start_job(out, scenario, strategy), timeout)


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


@pytest.fixture(scope="module")
def overflow_jobs(tmp_path_factory):
    """One job per strategy, side by side (most of each is starting Python, torch and Lightning)."""
    dirs = {strategy: tmp_path_factory.mktemp(f"overflow-{strategy}") for strategy in STRATEGIES}
    procs = {strategy: start_job(d, "overflow", strategy) for strategy, d in dirs.items()}
    return {strategy: (dirs[strategy], finish(proc, timeout=300.0)) for strategy, proc in procs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_overflow_on_one_rank_is_skipped_everywhere_while_rank0_reads_state(overflow_jobs, strategy):
    out, job = overflow_jobs[strategy]
    assert job.returncode == 0, job.stderr[-3000:]
    r0, r1 = (torch.load(out / f"rank{r}.pt") for r in (0, 1))
    assert r0["steps"] == r1["steps"] == 6
    # trace[i] is after step i: steps 2 and 3 (rank 1's infinite loss) changed nothing on either rank
    assert r0["changed"] == r1["changed"] == [True, False, False, True, True]
    assert r0["scale"] == r1["scale"] == 2.0**8 / 4  # halved at each overflow (hysteresis 1)
    assert r0["reads"] == 6 and r1["reads"] == 0


ERRORS = [(scenario, message, strategy) for scenario, message in
          (("sharded", "lightning_module_state_dict()"), ("collective", "full_state_dict()"),
           ("save", "trainer.save_checkpoint() (ModelCheckpoint"))
          for strategy in ("zero2", "zero3")]


@pytest.fixture(scope="module")
def error_jobs(tmp_path_factory):
    """The four jobs at once: each spends most of its time waiting for the rank that never comes."""
    dirs = [tmp_path_factory.mktemp(f"{scenario}-{strategy}") for scenario, _, strategy in ERRORS]
    procs = [start_job(d, scenario, strategy) for d, (scenario, _, strategy) in zip(dirs, ERRORS)]
    return [(d, finish(p)) for d, p in zip(dirs, procs)]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(ERRORS)), ids=[f"{s}-{g}" for s, _, g in ERRORS])
def test_an_error_on_rank0_only_ends_every_rank(error_jobs, case):
    out, job = error_jobs[case]
    assert job.returncode != 0
    assert ERRORS[case][1] in job.stderr, job.stderr[-3000:]
    assert not wait_gone(out, within=60.0), "a rank is still running after rank 0 failed"
    assert not (out / "rank1.pt").exists()
