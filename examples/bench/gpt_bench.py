#!/usr/bin/env python3
"""Throughput and memory of one GPT decoder training run under any Lightning strategy.

The model, data, optimizer, timing, FLOP count and memory readings follow the GPU anchors in
``/work/shared/anchor_bench`` (DeepSpeed / FSDP on one H200), so our figures can be put in the
same table:

* GPT decoder: pre-LN blocks, causal SDPA, 4x MLP with tanh-GELU, linear layers without bias,
  learned positions, separate embedding and lm_head, vocab 32000.
* Synthetic random tokens from a fixed pool; AdamW(lr 1e-4, betas (.9, .95), wd .1), fused on CUDA.
* Step time: wall clock between consecutive ``on_train_batch_end`` calls (``cuda.synchronize`` first),
  after ``--warmup`` untimed steps. tokens/s = all tokens of all ranks over the summed step times.
* FLOPs per token = 6 * N_flop + 12 * L * d * seq, with N_flop = every parameter except the token
  and position embeddings (lm_head counted). TFLOP/s counts all ranks; MFU = TFLOP/s per GPU / 790.
* Memory: ``torch.cuda.max_memory_allocated/reserved`` and host ``ru_maxrss`` of rank 0, read in
  ``on_train_end`` (before Lightning's teardown), after which the process leaves with ``os._exit``.

One run per process. Rank 0 prints ``RESULT {json}`` and appends the JSON to ``$OUT/results.jsonl``
(``./results.jsonl`` when OUT is unset).

Examples::

    python examples/bench/gpt_bench.py --strategy zero2                      # 1.3B on one GPU
    python examples/bench/gpt_bench.py --strategy zero3 --zero prefetch=2 wrap_modules=Block
    python examples/bench/gpt_bench.py --strategy ddp --accelerator cpu --devices 2 \\
        --layers 2 --d-model 64 --heads 4 --seq 32 --batch 2 --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import subprocess
import sys
import time
import traceback

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from bench_out import out_dir
from lightning.pytorch.callbacks import Callback
from torch.utils.checkpoint import checkpoint

PEAK_TFLOPS_PER_GPU = 790.0  # bf16 dense matmul measured on the H200 kind (see the anchors' NOTES.md)
GIB = float(1 << 30)
FSDP1_NAMES = ("fsdp", "fsdp_cpu_offload")


# ----------------------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention and a 4x tanh-GELU MLP, bias-free linears."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by heads={n_heads}")
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model, bias=False)
        self.fc2 = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).reshape(b, t, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (b, heads, t, head_dim)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, layers: int, d_model: int, n_heads: int, ckpt: bool = False):
        super().__init__()
        self.ckpt = ckpt
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if (self.ckpt and self.training) else block(x)
        return self.head(self.ln_f(x))


def param_counts(vocab: int, seq: int, layers: int, d: int) -> tuple[int, int]:
    """(total parameters, parameters in the FLOP count) from the shape alone, so that a strategy
    which shards or replaces parameters at construction cannot change the count."""
    per_block = 12 * d * d + 4 * d  # qkv 3d^2 + proj d^2 + fc1/fc2 8d^2, two LayerNorms (weight + bias)
    embeddings = vocab * d + seq * d
    total = embeddings + layers * per_block + 2 * d + vocab * d  # + ln_f + lm_head
    return total, total - embeddings


def flops_per_token(n_flop: int, layers: int, d: int, seq: int) -> int:
    return 6 * n_flop + 12 * layers * d * seq


class SyntheticTokens(torch.utils.data.Dataset):
    """Random token rows of length seq + 1 (input and shifted target), cycled from a fixed pool."""

    def __init__(self, vocab: int, seq: int, length: int, pool: int = 64):
        gen = torch.Generator().manual_seed(1234)
        self.rows = torch.randint(0, vocab, (pool, seq + 1), generator=gen)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i % self.rows.shape[0]]


# ------------------------------------------------------------------------------------ lightning
class BenchModule(pl.LightningModule):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.args = args
        self.model: GPT | None = None
        self.params_counted: int | None = None
        self.optimizer_name: str | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        a = self.args
        in_model_ckpt = a.ckpt and a.strategy not in FSDP1_NAMES  # FSDP1 checkpoints through its policy
        self.model = GPT(a.vocab, a.seq, a.layers, a.d_model, a.heads, ckpt=in_model_ckpt)
        self.params_counted = sum(int(getattr(p, "ds_numel", p.numel())) for p in self.model.parameters())
        if a.strategy == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=policy)
            fully_shard(self.model, mesh=mesh, mp_policy=policy)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self):
        a = self.args
        hyper = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}
        params = [p for p in self.parameters() if p.requires_grad]
        name = a.opt
        if name == "auto":
            if a.strategy.startswith("deepspeed") and "offload" in a.strategy:
                name = "ds_cpu_adam"
            elif a.clip and a.strategy in ("auto", "ddp") and self._on_cuda():
                name = "foreach"  # Lightning refuses to clip under mixed precision with a fused optimizer
            elif a.strategy == "fsdp_cpu_offload" or self._on_cuda():
                name = "fused"  # fsdp_cpu_offload steps on the CPU with torch's fused CPU kernel, like the anchor
            else:
                name = "foreach"
        self.optimizer_name = name
        if name == "ds_cpu_adam":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(params, adamw_mode=True, **hyper)
        if name == "fused":
            return torch.optim.AdamW(params, fused=True, **hyper)
        return torch.optim.AdamW(params, foreach=(name == "foreach"), **hyper)

    def _on_cuda(self) -> bool:
        try:
            return self.trainer.strategy.root_device.type == "cuda"
        except Exception:  # noqa: BLE001
            return torch.cuda.is_available() and self.args.accelerator in ("gpu", "cuda")


class RssSampler:
    """Peaks of this process's anonymous and file-backed resident memory (/proc/self/status, every 10 ms), by phase
    (``setup`` until training starts, then ``train``): ru_maxrss sums both kinds and cannot say when."""

    def __init__(self) -> None:
        import threading

        self.phase = "setup"
        self.peaks: dict[str, float] = {}
        if os.path.exists("/proc/self/status"):
            threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def read() -> dict[str, float]:
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0]) * 1024 / GIB
        return out

    def _run(self) -> None:
        while True:
            for key, value in self.read().items():
                name = f"{self.phase}_{key}"
                self.peaks[name] = max(self.peaks.get(name, 0.0), value)
            time.sleep(0.01)

    def record(self) -> dict[str, float]:
        return {f"host_peak_{k.lower()}_gib": round(v, 2) for k, v in sorted(self.peaks.items())}


class StepTimer(Callback):
    """Per-step wall time (device synchronized) after the warm-up steps; snapshot at train end."""

    def __init__(self, warmup: int, steps: int):
        self.warmup, self.steps = warmup, steps
        self.t_last: float | None = None
        self.step_times: list[float] = []
        self.losses: list[float] = []
        self.on_end = None
        self.cuda = False
        self.rss: RssSampler | None = None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_train_start(self, trainer, pl_module) -> None:
        self.cuda = trainer.strategy.root_device.type == "cuda"
        if self.rss is not None:
            self.rss.phase = "train"

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.warmup:
            self._sync()
            self.t_last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx in (0, self.warmup + self.steps - 1):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss.detach().float().item()))
        if batch_idx >= self.warmup:
            self._sync()
            now = time.perf_counter()
            self.step_times.append(now - self.t_last)
            self.t_last = now

    def on_train_end(self, trainer, pl_module) -> None:
        if self.on_end is not None:
            self.on_end(trainer)


# ----------------------------------------------------------------------------------- strategies
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lightning_zero_module():
    """The lightning_zero package (importing it registers zero1/zero2/zero3), or None when it is not
    there. The checkout this file lives in is tried when the package is not installed. An error
    raised inside the package is not hidden."""
    try:
        import lightning_zero
    except ModuleNotFoundError as e:
        if e.name != "lightning_zero":
            raise
        if not os.path.isfile(os.path.join(REPO_ROOT, "lightning_zero", "__init__.py")) or REPO_ROOT in sys.path:
            return None
        sys.path.append(REPO_ROOT)
        try:
            import lightning_zero
        except ModuleNotFoundError as e2:
            if e2.name != "lightning_zero":
                raise
            return None
    return lightning_zero


def parse_zero_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--zero expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def _coerce(raw: str, default):
    """Turn a command-line string into the type of the ZeroConfig field's default."""
    low = raw.lower()
    if low in ("none", "null"):
        return None
    if isinstance(default, bool) or low in ("true", "false"):
        if low not in ("true", "false", "1", "0", "yes", "no"):
            raise SystemExit(f"expected a boolean, got {raw!r}")
        return low in ("true", "1", "yes")
    if isinstance(default, tuple):
        return tuple(s.strip() for s in raw.split(",") if s.strip())
    if isinstance(default, int):
        value = float(raw)
        if value != int(value):
            raise SystemExit(f"expected an integer, got {raw!r}")
        return int(value)  # accepts 5e7
    if isinstance(default, float):
        return float(raw)
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    return raw


def build_zero_strategy(name: str, overrides: dict[str, str]):
    lz = lightning_zero_module()
    if lz is None:
        raise RuntimeError("--zero overrides need an importable lightning_zero")
    import dataclasses

    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else None)
                for f in dataclasses.fields(lz.ZeroConfig)}
    kwargs = {k: _coerce(v, defaults.get(k)) for k, v in overrides.items()}
    m = re.fullmatch(r"zero([123])", name)
    if m and "stage" not in kwargs:
        kwargs["stage"] = int(m.group(1))
    return lz.ZeroStrategy(config=lz.ZeroConfig(**kwargs)), kwargs


def make_strategy(a: argparse.Namespace):
    """A strategy name or object for pl.Trainer, plus a JSON-able description of extra settings."""
    s = a.strategy
    if s in ("auto", "single"):
        return "auto", {}
    if s == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=a.devices, tensor_parallel_size=1), {}
    if s in FSDP1_NAMES:
        from lightning.pytorch.strategies import FSDPStrategy

        kw = {"sharding_strategy": a.fsdp_sharding, "auto_wrap_policy": {Block}}
        if s == "fsdp_cpu_offload":
            kw["cpu_offload"] = True
        if a.ckpt:
            kw["activation_checkpointing_policy"] = {Block}
        return FSDPStrategy(**kw), {"fsdp_sharding": a.fsdp_sharding}
    if s.startswith("deepspeed"):
        if not a.pin_memory:
            return s, {}  # Lightning's registered configuration, unchanged
        from lightning.pytorch.strategies import DeepSpeedStrategy

        stage = 3 if "stage_3" in s else (2 if "stage_2" in s else 1)
        off = "offload" in s
        return DeepSpeedStrategy(stage=stage, offload_optimizer=off, offload_parameters=off and stage == 3,
                                 pin_memory=True), {}
    lz = lightning_zero_module()  # registers zero1/zero2/zero3 when importable
    overrides = parse_zero_overrides(a.zero)
    if overrides:
        strategy, kwargs = build_zero_strategy(s, overrides)
        return strategy, {"zero_config": kwargs}
    if s not in registered_strategies():
        where = "lightning_zero is not importable" if lz is None else "lightning_zero did not register it"
        raise RuntimeError(f"strategy {s!r} is not registered with Lightning ({where})")
    return s, {}


def registered_strategies() -> list[str]:
    from lightning.pytorch.strategies import StrategyRegistry

    return sorted(StrategyRegistry.available_strategies())


# ------------------------------------------------------------------------------------- planning
def zero_config_of(a: argparse.Namespace):
    """The ZeroConfig the run will use (a registered preset or --zero overrides), or None for other strategies."""
    lz = lightning_zero_module()
    if lz is None:
        return None
    overrides = parse_zero_overrides(a.zero)
    if overrides:
        return build_zero_strategy(a.strategy, overrides)[0].config
    from lightning_zero.presets import PRESETS

    m = re.fullmatch(r"zero([123])", a.strategy)
    if m:
        return lz.ZeroConfig(stage=int(m.group(1)))
    return {name: config for name, _, config in PRESETS}.get(a.strategy)


def plan_record(a: argparse.Namespace, n_total: int) -> dict:
    """lightning_zero's plan for this run: activations probed on this GPU, then the planner's bytes."""
    config = zero_config_of(a)
    if config is None:
        return {}
    from lightning_zero.planner import GiB, Hardware, estimate
    from lightning_zero.probe import next_token_step, probe_activations

    gen = torch.Generator().manual_seed(0)
    step = next_token_step(torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen).cuda())
    probe = probe_activations(lambda depth: GPT(a.vocab, a.seq, depth, a.d_model, a.heads, ckpt=a.ckpt),
                              a.layers, step, torch.device("cuda", torch.cuda.current_device()))
    total_gpu = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if a.gpu_mem_cap_gb > 0:
        total_gpu = int(a.gpu_mem_cap_gb * GiB)
    largest = 12 * a.d_model * a.d_model + 4 * a.d_model  # one block: the engine's stage-3 group
    row = estimate(n_total, config, Hardware(gpu_bytes=total_gpu), activations=probe.total,
                   accumulate=a.accumulate, largest_unit=largest)
    print(f"PLAN {probe.describe()}; {row.name}: GPU {row.gpu_total / GiB:.1f} GiB "
          f"(states {row.gpu_state / GiB:.1f}), host {row.host / GiB:.1f} GiB, fits={row.fits}", flush=True)
    return {"plan_name": row.name, "plan_activations_gib": round(probe.total / GiB, 2),
            "plan_activation_per_layer_gib": round(probe.per_layer / GiB, 3),
            "plan_gpu_states_gib": round(row.gpu_state / GiB, 2),
            "plan_gpu_total_gib": round(row.gpu_total / GiB, 2), "plan_host_gib": round(row.host / GiB, 2),
            "plan_fits": row.fits}


# ------------------------------------------------------------------------------------- helpers
def git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def env_info() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "lightning": pl.__version__,
            "python": sys.version.split()[0], "cpus": os.cpu_count(), "git": git_commit()}
    if torch.cuda.is_available():
        prop = torch.cuda.get_device_properties(0)
        info.update(gpu=prop.name, gpu_count=torch.cuda.device_count(), gpu_mem_gib=round(prop.total_memory / GIB, 1))
    for mod in ("deepspeed", "lightning_zero"):
        try:
            m = lightning_zero_module() if mod == "lightning_zero" else __import__(mod)
            info[mod] = getattr(m, "__version__", "importable") if m is not None else "unavailable"
        except Exception as e:  # noqa: BLE001
            info[mod] = f"unavailable: {type(e).__name__}: {str(e)[:200]}"
    info["strategies"] = registered_strategies()
    return info


def jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    return str(obj)


def global_rank(trainer=None) -> int:
    """This process's rank: the trainer's, the process group's, or (before either exists) the
    environment's (Lightning's launcher starts ranks 1.. with LOCAL_RANK set; one node only)."""
    if trainer is not None:
        return int(trainer.global_rank)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    for var in ("RANK", "GLOBAL_RANK", "LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", default="auto",
                    help="auto | ddp | fsdp | fsdp_cpu_offload | fsdp2 | deepspeed_stage_{1,2,3}[_offload] | "
                         "zero1 | zero2 | zero3 | any registered Lightning strategy name")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8, help="micro-batch per rank (sequences per step)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    ap.add_argument("--precision", default=None,
                    help="Lightning precision (32-true, bf16-mixed, bf16-true, 16-mixed); "
                         "default bf16-mixed on GPU, 32-true on CPU")
    ap.add_argument("--ckpt", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="micro-batches per optimizer step (--warmup/--steps count optimizer steps)")
    ap.add_argument("--devices", type=int, default=1, help="ranks on this host (tokens/s counts all of them)")
    ap.add_argument("--accelerator", default="gpu", help="gpu | cpu (cpu ranks talk over gloo)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank on CPU (0: cpus / devices)")
    ap.add_argument("--opt", default="auto", choices=["auto", "fused", "foreach", "forloop", "ds_cpu_adam"],
                    help="AdamW implementation (auto: fused on CUDA, foreach on CPU, DeepSpeedCPUAdam for DS offload)")
    ap.add_argument("--zero", nargs="*", default=[], metavar="KEY=VALUE",
                    help="lightning_zero.ZeroConfig overrides, e.g. --zero reduce_bucket_size=2e8 overlap_comm=false "
                         "(builds ZeroStrategy(config=ZeroConfig(stage=N, ...)) for zeroN)")
    ap.add_argument("--fsdp-sharding", default="FULL_SHARD", help="FSDP1 sharding_strategy")
    ap.add_argument("--pin-memory", action="store_true", help="DeepSpeed offload with pin_memory=True")
    ap.add_argument("--gpu-mem-cap-gb", type=float, default=0.0,
                    help="cap the caching allocator to this many GiB (set_per_process_memory_fraction)")
    ap.add_argument("--plan", action="store_true",
                    help="zero strategies on a GPU: probe this model's activations (depth 2 and 3, same micro-batch) and "
                         "record lightning_zero's planned GPU / host peaks beside the measured ones")
    ap.add_argument("--clip", type=float, default=0.0, help="gradient_clip_val (global norm); 0: none")
    ap.add_argument("--tag", default="")
    ap.add_argument("--profile", default="", metavar="PATH",
                    help="Lightning's PyTorch profiler over the last but one optimizer step (--warmup + --steps); its chrome "
                         "trace is written to PATH (summarize it with trace_summary.py); timings then include it")
    ap.add_argument("--no-fast-exit", dest="fast_exit", action="store_false",
                    help="run Lightning's teardown instead of os._exit right after the measurement")
    ap.add_argument("--env", action="store_true", help="print the environment as one ENV {json} line and exit")
    a = ap.parse_args(argv)
    if a.accelerator == "cuda":
        a.accelerator = "gpu"
    if a.precision is None:
        a.precision = "32-true" if a.accelerator == "cpu" else "bf16-mixed"
    return a


def step_profiler(path: str, skip_steps: int, accumulate: int):
    """Lightning's PyTorchProfiler recording one optimizer step (its ``accumulate`` micro-batches) after
    ``skip_steps`` steps, up to the next step's forward, its chrome trace written to ``path``."""
    from lightning.pytorch.profilers import PyTorchProfiler

    def export(prof) -> None:
        prof.export_chrome_trace(path)

    schedule = torch.profiler.schedule(wait=max(0, skip_steps * accumulate - 1), warmup=1, active=accumulate + 1, repeat=1)
    extra = {}
    try:  # the host step and the host adds run on worker threads: record those too where torch can
        extra["experimental_config"] = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        pass
    return PyTorchProfiler(schedule=schedule, on_trace_ready=export, record_shapes=False, **extra)


# ---------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    a = parse_args(argv)
    if a.env:
        print("ENV " + json.dumps(env_info()), flush=True)
        return 0
    t_launch = time.perf_counter()
    on_gpu = a.accelerator == "gpu" and torch.cuda.is_available()
    if a.accelerator == "cpu":
        threads = a.threads or max(1, (os.cpu_count() or 1) // max(1, a.devices))
        torch.set_num_threads(threads)
    else:
        threads = torch.get_num_threads()
    n_total, n_flop = param_counts(a.vocab, a.seq, a.layers, a.d_model)
    rec = {"tag": a.tag, "clip": a.clip, "strategy": a.strategy, "layers": a.layers, "d_model": a.d_model, "heads": a.heads,
           "seq": a.seq, "vocab": a.vocab, "micro_batch": a.batch, "accumulate": a.accumulate, "precision": a.precision, "ckpt": a.ckpt,
           "devices": a.devices, "accelerator": a.accelerator, "warmup": a.warmup, "steps": a.steps,
           "params": n_total, "params_b": round(n_total / 1e9, 3), "params_flop": n_flop,
           "pin_memory": a.pin_memory, "gpu_mem_cap_gib": a.gpu_mem_cap_gb, "zero_overrides": a.zero,
           "git": git_commit() if global_rank() == 0 else None, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if a.accelerator == "cpu":
        rec["threads_per_rank"] = threads
    if on_gpu and a.gpu_mem_cap_gb > 0:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        frac = min(1.0, a.gpu_mem_cap_gb * GIB / torch.cuda.get_device_properties(local).total_memory)
        torch.cuda.set_per_process_memory_fraction(frac, local)
        rec["mem_fraction"] = round(frac, 4)

    if a.plan and on_gpu:
        try:
            rec.update(plan_record(a, n_total))
        except Exception as e:  # noqa: BLE001  (the run itself still goes on)
            rec["plan_error"] = f"{type(e).__name__}: {str(e)[:300]}"

    module = BenchModule(a)
    acc = a.accumulate
    timer = StepTimer(a.warmup * acc, a.steps * acc)  # times micro-batches; grouped into steps below
    timer.rss = RssSampler()
    state = {"done": False}

    def finish(status: str, error: str | None = None, trainer=None) -> int:
        state["done"] = True
        rec["status"] = status
        if error:
            rec["error"] = error
        world = trainer.world_size if trainer is not None else a.devices
        rank = global_rank(trainer)
        rec["world_size"] = world
        if status == "ok" and len(timer.step_times) < a.steps * acc:
            rec["status"], rec["error"] = "fail", f"only {len(timer.step_times)} timed steps completed"
        rec["wall_s"] = round(time.perf_counter() - t_launch, 1)
        rec["optimizer"] = module.optimizer_name
        strategy = trainer.strategy if trainer is not None else None
        engine = getattr(strategy, "engine", None) or getattr(strategy, "_parked", None)
        if getattr(engine, "offloader", None) is not None:  # offload diagnostics (lightning_zero)
            rec["offload_stepped_in_backward"] = engine.offloader.stepped_in_backward
            rec["offload_speculations_undone"] = engine.offloader.speculations_undone
            rec["offload_seconds"] = {k: round(v, 3) for k, v in engine.offloader.seconds.items()}
        rec["params_counted"] = module.params_counted
        micro = timer.step_times[: a.steps * acc]
        times = [sum(micro[i:i + acc]) for i in range(0, len(micro) - acc + 1, acc)]  # optimizer steps
        if times:
            tokens_per_step = a.batch * a.seq * world * acc
            total = sum(times)
            tps = tokens_per_step * len(times) / total
            tflops = tps * flops_per_token(n_flop, a.layers, a.d_model, a.seq) / 1e12
            rec.update(timed_steps=len(times), step_s_mean=round(total / len(times), 4),
                       step_s_median=round(sorted(times)[len(times) // 2], 4), step_s_min=round(min(times), 4),
                       step_s_max=round(max(times), 4), step_s_all=[round(t, 4) for t in times],
                       tokens_per_s=round(tps, 1), tflops=round(tflops, 3),
                       tflops_per_gpu=round(tflops / world, 3), mfu=round(tflops / world / PEAK_TFLOPS_PER_GPU, 4))
        if timer.losses:
            rec["loss_first"] = round(timer.losses[0], 4)
            rec["loss_last"] = round(timer.losses[-1], 4)
            if not all(math.isfinite(x) for x in timer.losses):
                rec["loss_nonfinite"] = True
        if on_gpu:
            rec["gpu_peak_alloc_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
            rec["gpu_peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 2)
        rec["host_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 3)
        if timer.rss is not None:
            rec.update(timer.rss.record())
        if rank != 0:
            return 0 if rec["status"] == "ok" else 1
        line = json.dumps(jsonable(rec))
        print("RESULT " + line, flush=True)
        with open(os.path.join(out_dir(), "results.jsonl"), "a") as f:
            f.write(line + "\n")
        return 0 if rec["status"] == "ok" else 1

    def on_end(trainer) -> None:
        report = getattr(trainer.strategy, "memory_report", None)
        if callable(report):  # every rank calls it, in case it gathers
            try:
                rep = report()
                rec["memory_report"] = jsonable(rep.as_dict())
                if global_rank(trainer) == 0:
                    print(rep.format(), flush=True)
            except Exception as e:  # noqa: BLE001
                rec["memory_report_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        code = finish("ok", trainer=trainer)
        if a.fast_exit:  # skip teardown (state copies back to the CPU): not measured, can be slow
            try:
                if torch.distributed.is_available() and torch.distributed.is_initialized():
                    torch.distributed.barrier()
            except Exception:  # noqa: BLE001
                pass
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    timer.on_end = on_end
    try:
        strategy, extra = make_strategy(a)
        rec.update(extra)
        trainer = pl.Trainer(accelerator=a.accelerator, devices=a.devices, num_nodes=1, strategy=strategy,
                             precision=a.precision, max_steps=a.warmup + a.steps, logger=False,
                             accumulate_grad_batches=acc, gradient_clip_val=a.clip or None,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[timer],
                             profiler=step_profiler(a.profile, max(0, a.warmup + a.steps - 2), acc) if a.profile else None)
        data = SyntheticTokens(a.vocab, a.seq, (a.warmup + a.steps + 2) * a.batch * acc)
        loader = torch.utils.data.DataLoader(data, batch_size=a.batch, shuffle=False, num_workers=0, drop_last=True)
        trainer.fit(module, train_dataloaders=loader)
    except BaseException as e:  # noqa: BLE001  (OOMs, missing strategies, ... are recorded)
        if isinstance(e, KeyboardInterrupt):
            raise
        traceback.print_exc()
        text = str(e).strip()
        if state["done"]:
            return 1
        return finish("fail", f"{type(e).__name__}: {text.splitlines()[0][:400] if text else ''}")
    if not state["done"]:
        return finish("ok", trainer=trainer)
    return 0 if rec.get("status") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
