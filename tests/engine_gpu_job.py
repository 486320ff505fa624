"""``torchrun --nproc_per_node 1 tests/engine_gpu_job.py OUT``: lightning_zero.initialize on a GPU
(NCCL, pinned offload) beside DDP on the same GPU; tests/test_gpu.py compares them."""

from __future__ import annotations

import sys

import torch
from engine_api_cases import ddp_reference, engine_run
from test_engine_api import STAGES  # noqa: E402  (the same configurations as the CPU test)

if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = {name: engine_run(0, 1, zero, 16) for name, zero in STAGES.items()}  # the first creates the NCCL group
    out["ddp"] = ddp_reference(0, 1, 16, device="cuda" if torch.cuda.is_available() else "cpu")  # CPU: a dry run
    torch.save(out, sys.argv[1])
