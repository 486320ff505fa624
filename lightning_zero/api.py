"""DeepSpeed's entry points without DeepSpeed: ``initialize``, ``init_distributed``, ``add_config_arguments``.

A DeepSpeed training script runs with its import line changed (``import lightning_zero as deepspeed``)::

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args()                       # --deepspeed --deepspeed_config ds_config.json
    deepspeed.init_distributed()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset)
    model.train()
    for batch in loader:
        loss = engine(batch)                 # forward (autocast in 16-bit modes)
        engine.backward(loss)                # / accumulation steps, fp16 loss scaling, no reduction mid-window
        engine.step()                        # at the boundary: overflow vote, clip, step or skip, scheduler
    engine.save_checkpoint("ckpt")           # also loads DeepSpeed's own checkpoint directories

Launched by ``torchrun`` (or as one process); NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from . import ds_glue, process_group
from .collectives import Comm
from .config import ZeroConfig
from .ds_config import DeepSpeedConfigError, DeepSpeedImport, import_deepspeed_config
from .engine.materialize import has_meta, move_all_but_flattened
from .model_engine import ZeroModelEngine
from .zero import init_rng_for

__all__ = ["initialize", "init_distributed", "add_config_arguments", "ZeroModelEngine"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags: ``--deepspeed`` and ``--deepspeed_config PATH`` (and the legacy
    ``--deepscale`` / ``--deepscale_config``), read by ``initialize(args=...)``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (read by lightning_zero)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (lightning_zero reads --deepspeed_config either way)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True, timeout: timedelta = timedelta(minutes=30),
                     init_method: Optional[str] = None, dist_init_required: Optional[bool] = None,
                     config: Any = None, rank: int = -1, world_size: int = -1) -> None:
    """Start the default process group as DeepSpeed does: from torchrun's / SLURM's environment, or as a group of
    one when the script was started as a plain process (so ``torch.distributed`` calls in it work)."""
    if dist.is_initialized() or dist_init_required is False:
        return
    # LIGHTNING_ZERO_BACKEND=gloo: several ranks on one GPU (NCCL refuses that), as in the GPU tests
    backend = dist_backend or os.environ.get("LIGHTNING_ZERO_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    env = os.environ
    for key, value in slurm_launch_env(env).items():
        env.setdefault(key, value)
    if rank >= 0 and world_size > 0:
        env.setdefault("RANK", str(rank))
        env.setdefault("WORLD_SIZE", str(world_size))
    _device()
    if "WORLD_SIZE" in env:
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(distributed_port))
        dist.init_process_group(backend, init_method=init_method, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    process_group.exit_hook.arm()  # see [Note: destroy the group at exit]


def slurm_launch_env(env: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables from SLURM's, for a script started by ``srun`` on each task (no torchrun): the rank, the
    world, the local rank and the node's task count (host memory and cores are shared by the node's ranks), and
    the first node of the job as the rendezvous address (the default 127.0.0.1 would leave other nodes waiting)."""
    if "WORLD_SIZE" in env or "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return {}
    out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"], "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}
    per_node = _tasks_per_node(env.get("SLURM_TASKS_PER_NODE", ""))
    node = int(env.get("SLURM_NODEID", "0"))
    if node < len(per_node):
        out["LOCAL_WORLD_SIZE"] = str(per_node[node])
    nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodes:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        out["MASTER_ADDR"] = SLURMEnvironment.resolve_root_node_address(nodes)
    return out


def _tasks_per_node(spec: str) -> list[int]:
    """SLURM's ``SLURM_TASKS_PER_NODE``: "2(x3),1" is 2, 2, 2, 1."""
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """DeepSpeed's rules: ``config`` or its legacy name ``config_params``, or ``args.deepspeed_config``; never two."""
    if config is not None and config_params is not None:
        raise DeepSpeedConfigError("initialize() got both config= and config_params=: pass one (config_params is "
                                   "its legacy name).")
    config = config if config is not None else config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None and config is not None:
        raise DeepSpeedConfigError(f"initialize() got a config twice: args.deepspeed_config={from_args!r} and "
                                   f"config=...; drop one of them (DeepSpeed refuses this too).")
    return config if config is not None else from_args


def _import(source: Any) -> DeepSpeedImport:
    if isinstance(source, DeepSpeedImport):
        return source
    if source is None or isinstance(source, ZeroConfig):
        return DeepSpeedImport(zero=source or ZeroConfig())
    return import_deepspeed_config(source)


def _trainable(model_parameters: Any, model: nn.Module) -> Any:
    """The parameters to optimize: tensors or param-group dicts, as DeepSpeed accepts them; frozen ones left out."""
    given = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if given and isinstance(given[0], dict):
        return [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in given]
    return [p for p in given if p.requires_grad]


def initialize(args: Any = None, model: Optional[nn.Module] = None,
               optimizer: Union[torch.optim.Optimizer, Callable[[Any], torch.optim.Optimizer], None] = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: Optional[bool] = None,
               collate_fn: Optional[Callable] = None, config: Union[str, Path, dict, ZeroConfig, None] = None,
               mesh_param: Any = None, config_params: Any = None,
               ) -> tuple[ZeroModelEngine, torch.optim.Optimizer, Any, Any]:
    """``(engine, optimizer, dataloader, lr_scheduler)`` as ``deepspeed.initialize`` returns them.

    The config is ``config`` (a DeepSpeed JSON path or dict, or a ZeroConfig) or ``args.deepspeed_config``.
    ``optimizer`` / ``lr_scheduler`` may be objects or callables taking the parameters / the optimizer; without
    them the JSON's ``optimizer`` / ``scheduler`` sections build them. ``dataloader`` is None unless
    ``training_data`` is given.
    """
    if model is None:
        raise ValueError("initialize() needs model=...: the nn.Module to train.")
    if mpu is not None or mesh_param is not None:
        raise ValueError("initialize(mpu=... / mesh_param=...): lightning_zero shards over data parallelism only; "
                         "tensor/pipeline model parallelism is not supported.")
    ds = _import(_config_source(args, config, config_params))
    if dist_init_required is not False and not dist.is_initialized():  # as DeepSpeed: a plain process is a group of 1
        init_distributed(distributed_port=distributed_port)
    device = _device()
    comm = Comm.from_group(None, timeout_s=ds.zero.collective_timeout_s).with_control()
    if ds.warnings and comm.rank == 0:
        warnings.warn("lightning_zero read the DeepSpeed config: " + "; ".join(ds.warnings) + ".", stacklevel=2)
    meta = has_meta(model)
    if not meta:  # the engine copies the floating-point parameters to the device unit by unit
        move_all_but_flattened(model, device)
    params = _trainable(model_parameters, model)
    if optimizer is not None and not callable(optimizer) and ds.optimizer is not None and comm.rank == 0:
        warnings.warn("initialize() got an optimizer and the DeepSpeed config has an \"optimizer\" section: the "
                      "passed optimizer is used, the config's ignored.", stacklevel=2)
    optimizer, lr_scheduler = ds_glue.optimizer_and_scheduler(ds, params, optimizer, lr_scheduler)
    engine = ZeroModelEngine(model, optimizer, ds, device, int(os.environ.get("LOCAL_RANK", 0)), comm, lr_scheduler,
                             init_rng=init_rng_for(model) if meta else None)
    loader = engine.dataloader(training_data, collate_fn) if training_data is not None else None
    engine.training_dataloader = loader
    return engine, optimizer, loader, lr_scheduler
