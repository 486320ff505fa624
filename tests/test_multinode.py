"""Two nodes on localhost: torchrun --nnodes 2 --nproc-per-node 1, one agent per node rank (gloo).

Each node runs tests/multinode_job.py, which trains with Trainer(num_nodes=2, devices=1). A
finished job must exit 0 on both nodes, and ZeRO must match DDP.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_utils import free_port, job_env
from parity import assert_parity, loss_err

TESTS = Path(__file__).resolve().parent
JOB = TESTS / "multinode_job.py"
STRATEGIES = ("ddp", "zero2_buckets", "zero3")


def start_job(strategy: str, out_dir: Path) -> list[subprocess.Popen]:
    """Start both node agents; each in its own session so that a failure can kill its whole tree."""
    port = free_port()
    env = {**job_env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS.parent), os.environ.get("PYTHONPATH")]))}
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--max-restarts", "0", "--monitor-interval", "0.2", str(JOB), strategy, str(out_dir)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    return procs


def finish_job(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """(exit code, output) per node; kills both process trees when the deadline passes or one node fails."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break  # the other node would wait for its peer until the rendezvous/collective timeout
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return [(p.wait(), p.stdout.read()) for p in procs]


def run_job(strategy: str, out_dir: Path, timeout: float = 90.0) -> list[tuple[int, str]]:
    return finish_job(start_job(strategy, out_dir), timeout)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("multinode")
    # all jobs at once (each on its own port): the processes mostly wait for imports and each other
    started = {s: start_job(s, out) for s in STRATEGIES}
    results = {s: finish_job(procs, timeout=120.0) for s, procs in started.items()}
    return out, results


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_nodes_exit_zero(jobs, strategy):
    _, results = jobs
    for node, (code, output) in enumerate(results[strategy]):
        assert code == 0, f"{strategy}: node {node} exited with {code}:\n{output[-4000:]}"
        assert "terminate called" not in output, f"{strategy}: node {node}:\n{output[-4000:]}"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through /proc")
@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "ddp"])
def test_gloo_workers_joined_before_finalization(jobs, strategy):
    # A gloo worker alive during interpreter finalization can abort a finished job (SIGABRT,
    # "terminate called without an active exception"): see [Note: destroy the group at exit] in
    # lightning_zero/process_group.py. The race is rare; what prevents it is checked every time: when the last exit
    # handler runs, no process group (and so no gloo worker thread) is left.
    out, results = jobs
    assert all(code == 0 for code, _ in results[strategy])
    for rank in (0, 1):
        threads = (out / f"{strategy}_rank{rank}_threads.txt").read_text().split()
        assert not any(t.startswith(("pt_gloo", "gloo")) for t in threads), (rank, threads)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "ddp"])
def test_two_nodes_match_ddp(jobs, strategy):
    out, results = jobs
    assert all(code == 0 for code, _ in results[strategy] + results["ddp"])
    for rank in (0, 1):
        run = torch.load(out / f"{strategy}_rank{rank}.pt")
        ref = torch.load(out / f"ddp_rank{rank}.pt")
        assert len(ref["losses"]) == 4 and bool(run["state"]) == bool(ref["state"]) == (rank == 0)
        if rank == 0:
            assert_parity(run, ref)  # the final state and rank 0's losses
        else:
            assert loss_err(run["losses"], ref["losses"]) <= 1e-5


def test_srun_tasks_get_torchruns_variables_with_the_first_node_as_rendezvous():
    """A DeepSpeed-style script started by ``srun`` on every task (no torchrun): init_distributed reads SLURM's
    variables; the rendezvous is the job's first node (127.0.0.1 would leave the other nodes waiting) and the node's
    task count is its local world (host memory and cores are split by it)."""
    from lightning_zero.api import slurm_launch_env

    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_NODELIST": "gpu[012-015]"}
    assert slurm_launch_env(env) == {"RANK": "5", "WORLD_SIZE": "7", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                     "MASTER_ADDR": "gpu012"}
    assert slurm_launch_env({**env, "SLURM_NODEID": "3"})["LOCAL_WORLD_SIZE"] == "1"
    assert slurm_launch_env({**env, "WORLD_SIZE": "7"}) == {}  # torchrun under srun: its own variables stand
