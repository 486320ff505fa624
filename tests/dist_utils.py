"""Run a function on N gloo ranks (CPU) and collect what each rank returns."""

from __future__ import annotations

import faulthandler
import io
import os
import signal
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Set in this process by in-process Trainers (Lightning exports MASTER_PORT, ...): a job started as a
# subprocess must not inherit them, or it would join a rendezvous that no longer exists.
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE",
               "GROUP_RANK", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED")


def job_env(**extra: str) -> dict:
    """This process's environment without distributed launch variables, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, queue, lightning: bool, one_gpu: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if one_gpu:  # each rank a "node" of one device: all of them on cuda:0 (Trainer(devices=1, num_nodes=world))
        os.environ.update(LOCAL_RANK="0", RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK=str(rank),
                          LOCAL_WORLD_SIZE="1")
    elif lightning:  # torchrun-style variables: Lightning joins these processes instead of launching its own
        os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0",
                          LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` prints where a stuck rank is
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        if not lightning:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args), buf)  # bytes: tensors must not share memory with a dead process
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent re-raises with the child's traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_zero"]


def _context():
    """A forkserver that has imported torch and Lightning once: each rank forks from it instead of
    importing them again (seconds per rank on a 2-core machine); a preload that fails falls back to a
    plain import in the child. With CUDA present, ranks are spawned as before."""
    if torch.cuda.is_available():  # the GPU machine: spawn, the path validated there (no fork near CUDA)
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(fn, world: int, *args, timeout: float = 300.0, lightning: bool = False, one_gpu: bool = False) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; returns the per-rank results in rank order.

    With ``lightning=True`` no process group is started here: the function builds a Trainer
    (``devices=world``), which finds the torchrun-style environment and joins it. ``one_gpu=True``
    makes each rank a node of one device, all on cuda:0 (``Trainer(devices=1, num_nodes=world)``,
    gloo: NCCL refuses two ranks on one GPU).
    """
    # A fixed mmap threshold makes glibc return large freed blocks to the OS, so that peak RSS
    # measures what a process really held rather than heap fragmentation.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue, lightning or one_gpu, one_gpu)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def full_state(trainer) -> dict:
    """The trained full state dict as each rank sees it: ZeroStrategy gathers it (stage 3 to rank 0
    only, ``{}`` elsewhere); other strategies (DDP) hold it in the module."""
    strategy = trainer.strategy
    if hasattr(strategy, "full_state_dict"):
        return strategy.full_state_dict(rank0_only=strategy.config.shard_params)
    return trainer.lightning_module.state_dict()


def trained_state(trainer, module) -> dict:
    """The trained weights after fit on every rank, as float CPU copies: stage 3 keeps the module
    sharded after fit, so they are gathered (``full_state_dict``); other strategies hand the
    module back holding them."""
    strategy = trainer.strategy
    if getattr(getattr(strategy, "config", None), "shard_params", False):
        state = strategy.full_state_dict(rank0_only=False)
    else:
        state = module.state_dict()
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}
