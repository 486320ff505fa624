#!/usr/bin/env python3
"""Save and restore time and memory of one strategy's checkpoint, on the GPT benchmark model.

Two processes per measurement (``--phase save``, then ``--phase restore``), so that the restore
starts from a fresh process as a resumed job does:

* save: train ``--train-steps`` steps (optimizer state exists), then in ``on_train_end``
  ``trainer.save_checkpoint(PATH)`` on every rank. Reported: wall time, bytes on disk, host RSS
  growth (peak during the save minus before it, sampled every 5 ms) and GPU allocation growth
  (``max_memory_allocated`` during the save minus allocated before).
* restore: a new model and Trainer, ``fit(ckpt_path=PATH)`` up to ``on_train_start`` (weights and
  optimizer state loaded). Reported: wall time from the ``fit`` call, the same for a fit without a
  checkpoint (measured in the save phase), host RSS growth over the RSS before ``fit`` and the GPU
  peak at ``on_train_start``.

The model and strategies come from gpt_bench.py (``--strategy zero2 --zero checkpoint_format=full``,
``deepspeed_stage_3``, ...). Rank 0 prints ``RESULT {json}`` and appends it to $OUT/ckpt.jsonl.

    python examples/bench/ckpt_bench.py --phase save --path /tmp/c.ckpt --strategy zero3
    python examples/bench/ckpt_bench.py --phase restore --path /tmp/c.ckpt --strategy zero3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from bench_out import out_dir
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).parent))
import gpt_bench  # noqa: E402

GiB = float(2**30)



def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    def __init__(self) -> None:
        self.base = self.peak = rss()
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss())
            time.sleep(0.005)

    def stop(self) -> float:
        self.running = False
        self.thread.join()
        return (max(self.peak, rss()) - self.base) / GiB


CUDA = torch.cuda.is_available()


def gpu_allocated(peak: bool = False) -> int:
    if not CUDA:
        return 0
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()


def disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class SaveAtEnd(Callback):
    def __init__(self, path: Path, t_fit: float) -> None:
        self.path, self.t_fit, self.out = path, t_fit, {}

    def on_train_start(self, trainer, pl_module):
        self.out["fit_to_train_start_s"] = time.perf_counter() - self.t_fit

    def on_train_end(self, trainer, pl_module):
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        before = gpu_allocated()
        trainer.strategy.barrier()
        peak = Peak()
        start = time.perf_counter()
        trainer.save_checkpoint(self.path)
        trainer.strategy.barrier()
        self.out.update(save_s=time.perf_counter() - start, save_host_growth_gib=peak.stop(),
                        save_gpu_growth_gib=(gpu_allocated(peak=True) - before) / GiB,
                        disk_gib=disk_bytes(self.path) / GiB, host_rss_gib=rss() / GiB)


class RestoredAt(Callback):
    def __init__(self, peak: Peak, t_fit: float) -> None:
        self.peak, self.t_fit, self.out = peak, t_fit, {}

    def on_train_start(self, trainer, pl_module):
        self.out.update(restore_s=time.perf_counter() - self.t_fit, restore_host_growth_gib=self.peak.stop(),
                        restore_gpu_peak_gib=gpu_allocated(peak=True) / GiB)
        trainer.should_stop = True  # measured: no training step follows


def main() -> int:
    extra = argparse.ArgumentParser()
    extra.add_argument("--phase", choices=["save", "restore"], required=True)
    extra.add_argument("--path", required=True)
    extra.add_argument("--train-steps", type=int, default=1)
    mine, rest = extra.parse_known_args()
    a = gpt_bench.parse_args(rest)
    path = Path(mine.path)
    strategy, settings = gpt_bench.make_strategy(a)
    module = gpt_bench.BenchModule(a)
    data = torch.utils.data.DataLoader(gpt_bench.SyntheticTokens(a.vocab, a.seq, 64 * a.batch), batch_size=a.batch)
    t_fit = time.perf_counter()
    if mine.phase == "save":
        probe = SaveAtEnd(path, t_fit)
        steps, ckpt_path = mine.train_steps, None
    else:
        probe = RestoredAt(Peak(), t_fit)
        steps, ckpt_path = mine.train_steps + 1, str(path)
    trainer = pl.Trainer(accelerator=a.accelerator, devices=a.devices, strategy=strategy, precision=a.precision,
                         max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[probe])
    trainer.fit(module, data, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        row = {"phase": mine.phase, "strategy": a.strategy, "settings": settings, "tag": a.tag,
               "params": module.params_counted, "host_rss_peak_gib": rss() / GiB, **probe.out}
        print("RESULT " + json.dumps(row), flush=True)
        with open(os.path.join(out_dir(), "ckpt.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        if mine.phase == "restore":
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
