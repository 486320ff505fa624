"""What the checkpoint checksums cost beside the write (lightning_zero/checkpoint/checksums.py).

    python examples/bench/checksum_bench.py [--gib 1.0] [--dir /tmp]

Writes a one-rank sharded checkpoint of a model of the given size (fp32 weights + Adam moments, 12 bytes a
parameter) with the real save path, then times the checksum pass over the files it wrote (as the save runs
it, right after the write) and a full verification (as a reader runs it). Prints the figures.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    import lightning_zero
    from lightning_zero.checkpoint import checksums, sharded

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    width = 4096
    layers = max(1, int(args.gib * 2**30 / 12 / (width * width)))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    engine, opt, _, _ = lightning_zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    engine.backward(engine(torch.randn(1, width)).sum())
    engine.step()
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        start = time.perf_counter()
        engine.save_checkpoint(root, tag="t")
        total = time.perf_counter() - start
        files = sorted((root / "t").glob("*.distcp"))
        size = sum(f.stat().st_size for f in files)
        start = time.perf_counter()
        checksums.file_checksums(files)
        crc = time.perf_counter() - start
        start = time.perf_counter()
        problem = checksums.verify(root / "t")
        verify = time.perf_counter() - start
        assert problem is None, problem
        print(f"{size / 2**30:.2f} GiB in {len(files)} files: save {total:.2f} s (checksums included), checksum pass "
              f"{crc:.2f} s ({size / crc / 1e9:.2f} GB/s, {crc / total:.0%} of the save), full verify {verify:.2f} s; "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads")
        del sharded
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
