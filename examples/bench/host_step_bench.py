#!/usr/bin/env python3
"""The host optimizer step against the host's memory bandwidth.

An offloaded AdamW step streams 28 bytes a parameter (reads parameter, gradient and two moments,
writes parameter and moments): it is bound by memory bandwidth, not arithmetic. This measures, with
``--ranks`` processes each pinned to its own share of the cores (as the ranks of a node share it):

- a STREAM-like copy (``a.copy_(b)``) and triad (``a = b + s * c``), counted as the memory really moves: a
  store to a line not yet read first reads it (write-allocate), so copy moves 12 bytes an fp32 element
  and triad 16 (STREAM's own convention counts 8 and 12 and so reads ~25% low);
- an in-place update (``a += s * b``: reads a and b, writes a, 12 bytes): the access pattern of an
  optimizer, whose every store goes to a line it has just read;
- torch's fused CPU AdamW (what the engine's host step runs), over chunks of ``--chunk`` elements:
  reads parameter, gradient and both moments, writes parameter and moments, 28 bytes a parameter,

and prints each as GB/s summed over the ranks, and AdamW's share of the best of them (the bandwidth).

usage: python examples/bench/host_step_bench.py [--params 2e8] [--ranks 1] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _rank(rank: int, ranks: int, n: int, chunk: int, repeat: int, barrier, out) -> None:
    import torch

    cores = _cores()
    mine = cores[rank * len(cores) // ranks:(rank + 1) * len(cores) // ranks] or cores
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    a, b, c = (torch.rand(n) for _ in range(3))
    barrier.wait()
    copy = _best(lambda: a.copy_(b), repeat)
    barrier.wait()
    triad = _best(lambda: torch.add(b, c, alpha=0.5, out=a), repeat)
    barrier.wait()
    update = _best(lambda: a.add_(b, alpha=0.5), repeat)
    a = b = c = None  # freed before the optimizer's buffers
    params = [torch.rand(min(chunk, n - i)) for i in range(0, n, chunk)]
    for p in params:
        p.grad = torch.rand_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    opt.step()  # creates the moments
    barrier.wait()
    step = _best(opt.step, repeat)
    out.put({"rank": rank, "cores": len(mine), "copy_s": copy, "triad_s": triad, "update_s": update, "adamw_s": step, "n": n})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=2e8, help="parameters per rank")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--chunk", type=float, default=64e6, help="elements a host-step chunk (the engine's)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n, chunk = int(args.params), int(args.chunk)
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(args.ranks), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, n, chunk, args.repeat, barrier, out))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = [out.get() for _ in procs]
    for p in procs:
        p.join()
    gbs = {name: sum(per * r["n"] / r[f"{name}_s"] for r in rows) / 1e9
           for name, per in (("copy", 12), ("triad", 16), ("update", 12), ("adamw", 28))}
    bandwidth = max(gbs["copy"], gbs["triad"], gbs["update"])
    record = {"ranks": args.ranks, "cores": sum(r["cores"] for r in rows), "params_per_rank": n,
              **{f"{k}_GBps": round(v, 1) for k, v in gbs.items()},
              "adamw_params_per_s": round(gbs["adamw"] / 28, 2), "adamw_vs_bandwidth": round(gbs["adamw"] / bandwidth, 2)}
    print("HOSTSTEP " + json.dumps(record))
    print(f"{args.ranks} rank(s) x {rows[0]['cores']} cores, bytes as moved: copy {gbs['copy']:.1f} GB/s, triad "
          f"{gbs['triad']:.1f}, in-place update {gbs['update']:.1f}; fused AdamW {gbs['adamw']:.1f} GB/s "
          f"({record['adamw_params_per_s']}e9 params/s) = {record['adamw_vs_bandwidth']:.0%} of the best")


if __name__ == "__main__":
    main()
