"""Two ranks sharing one GPU over gloo: the CUDA paths (streams, events, asynchronous multi-rank
collectives) run for real on a one-GPU machine. Deterministic kernels, so that fp32 runs differ
from DDP only by what ZeRO changes."""

from __future__ import annotations

import os

import torch
from model_zoo import fit_zoo


def gpu_zoo_many(rank: int, world: int, runs: dict) -> dict:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = {}
    for name, (args, kwargs) in runs.items():
        out[name] = fit_zoo(rank, world, *args, one_gpu=True, **kwargs)
        out[name]["device_count"] = torch.cuda.device_count()
    return out
