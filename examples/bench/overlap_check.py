#!/usr/bin/env python3
"""Does communication overlap computation on the GPU? A profiler timeline answers.

Trains a stack of large Linear layers with the ZeroEngine (stage 2 and 3) for a few steps
under torch.profiler and reports, for the NCCL kernels of the measured steps, how much of
their time ran concurrently with compute kernels. On one GPU set
LIGHTNING_ZERO_FORCE_COLLECTIVES=1 so that the one-rank collectives still run as NCCL
kernels on NCCL's stream (on several GPUs they are real transfers).

    LIGHTNING_ZERO_FORCE_COLLECTIVES=1 python examples/bench/overlap_check.py
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from lightning_zero import ZeroConfig, ZeroEngine
from lightning_zero.collectives import Comm


def _union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _overlap(a, merged):
    s, e = a
    return sum(max(0.0, min(e, me) - max(s, ms)) for ms, me in merged)


def measure(stage: int, layers: int, dim: int, tokens: int, prefetch: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    cfg = ZeroConfig(stage=stage, reduce_bucket_size=dim * dim, wrap_modules=("Sequential",) if stage == 3 else (),
                     prefetch=prefetch, param_persistence_threshold=0)
    engine = ZeroEngine(model, [opt], cfg, Comm.from_group(), torch.device("cuda"), torch.bfloat16)
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)

    def step():
        engine.backward(model(x).float().square().mean())
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0]
    comm = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
    compute = _union([(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()])
    comm_us = sum(e - s for s, e in comm)
    hidden = sum(_overlap(c, compute) for c in comm)
    return {"stage": stage, "prefetch": prefetch, "nccl_kernels": len(comm), "nccl_ms": round(comm_us / 1e3, 2),
            "overlapped_ms": round(hidden / 1e3, 2), "overlap_fraction": round(hidden / comm_us, 3) if comm_us else 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8192)
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    torch.cuda.set_device(0)
    for stage, prefetch in ((2, 1), (3, 1), (3, 0)):
        print("OVERLAP", measure(stage, a.layers, a.dim, a.tokens, prefetch), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
