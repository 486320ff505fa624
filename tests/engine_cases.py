"""Training loops shared by the engine parity tests: one ZeRO run and one DDP reference run.

Both see the same data per rank, the same initial weights and the same optimizer; the test
compares their loss trajectories and final parameters.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.collectives import Comm
from lightning_zero.config import ZeroConfig
from lightning_zero.engine import ZeroEngine


class TiedNet(nn.Module):
    """Embedding tied to the output head, a frozen layer, a layer used twice, a LayerNorm."""

    def __init__(self, vocab: int = 37, dim: int = 24, frozen: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, 3 * dim)
        self.fc2 = nn.Linear(3 * dim, dim)
        self.shared = nn.Linear(dim, dim)
        self.frozen = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        if frozen:
            self.frozen.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.fc2(torch.relu(self.fc1(x)))
        x = self.shared(torch.tanh(self.shared(x)))  # a module called twice
        x = self.frozen(x)
        return self.head(self.norm(x))


def make_batches(rank: int, steps: int, micro: int, vocab: int = 37) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, vocab, (4, 9), generator=g) for _ in range(steps * micro)]


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))


def run_case(rank: int, world: int, mode: str, stage: int, steps: int = 4, micro: int = 1,
             clip: str = "", opt: str = "adamw", bucket: int = 500, overlap: bool = True,
             options: dict | None = None, eval_inference: bool = False) -> dict:
    """Train ``steps`` optimizer steps; ``mode`` is "ddp" or "zero". Returns losses and final weights."""
    torch.manual_seed(0)
    model = TiedNet()
    if rank == 1:  # a rank with different initial weights: both DDP and ZeRO must broadcast rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    optimizer = make_optimizer(model, opt)
    if mode == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
        engine = None
    else:
        net = model
        config = ZeroConfig(stage=stage, reduce_bucket_size=bucket, overlap_comm=overlap, **(options or {}))
        engine = ZeroEngine(model, [optimizer], config, Comm.from_group(), "cpu")
    batches = make_batches(rank, steps, micro)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for m in range(micro):
            batch = batches[step * micro + m]
            last = m == micro - 1
            if engine is not None:
                with _null() if last else engine.no_sync():
                    loss = loss_of(net, batch) / micro
                    engine.backward(loss)
            else:
                ctx = net.no_sync() if not last else _null()
                with ctx:
                    loss = loss_of(net, batch) / micro
                    loss.backward()
            losses.append(float(loss.detach()))
        if clip == "norm":
            if engine is not None:
                engine.clip_grad_norm_(optimizer, 0.5)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        elif clip == "value":
            if engine is not None:
                engine.clip_grad_value_(optimizer, 0.01)
            else:
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        optimizer.step()  # routed through the engine when it adopted the optimizer
        if eval_inference:  # evaluation between steps, as Lightning runs it on NCCL
            with torch.inference_mode():
                losses.append(float(loss_of(net, batches[0])))
    if engine is not None:
        engine.unflatten()
    dist.barrier()
    state = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Several ``run_case`` calls in one process group (spawning is the slow part)."""
    return [run_case(rank, world, **case) for case in cases]


class Stack(nn.Module):
    """Linear layers without sharing: every parameter is gathered exactly once per pass."""

    def __init__(self, dim: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def count_traffic(rank: int, world: int, stage: int) -> dict:
    """Bytes each collective moved in one optimizer step, and the padded model size in bytes."""
    torch.manual_seed(0)
    model = Stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    numel = sum(p.numel() for p in model.parameters())  # before sharding empties them
    config = ZeroConfig(stage=stage, wrap_modules=("Linear",), param_persistence_threshold=0,
                        reduce_bucket_size=2000)
    comm = Comm.from_group()
    engine = ZeroEngine(model, [optimizer], config, comm, "cpu")
    x = torch.randn(8, 32)
    from traffic_tap import tap

    for _ in range(2):  # the second step is counted: nothing left from building the engine
        comm.reset_counters()
        with tap() as wire:
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    padded_bytes = sum(u.layout.padded_numel * 4 for u in engine.units)
    return {"moved": dict(comm.bytes_moved), "padded_bytes": padded_bytes,
            "params": numel, "wire": dict(wire)}


def launch_schedule(rank: int, world: int, overlap: bool) -> dict:
    """One backward of 8 one-layer buckets: when reductions were issued and waited for, in time
    order beside the moments backward reached each layer (hooks on the layers' outputs)."""
    import time

    torch.manual_seed(0)
    model = Stack(dim=32, layers=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=2, reduce_bucket_size=1100, overlap_comm=overlap),
                        Comm.from_group(), "cpu")
    trace: list = []
    engine.reducer.trace = trace

    def reached(i):
        def hook(grad):
            trace.append((time.perf_counter(), "backward", i))
        return hook

    x = torch.randn(4, 32)
    for i, layer in enumerate(model.layers):
        x = torch.tanh(layer(x))
        x.register_hook(reached(i))
    x.sum().backward()
    return {"units": len(engine.units), **engine.reducer.launches, "trace": [(w, k) for _, w, k in sorted(trace)]}


def accumulation_error(rank: int, world: int, accum_dtype: str, micro: int = 64) -> dict:
    """Stage 1, bf16 module, ``micro`` micro-batches in one window: the engine's reduced gradient
    against the exact (fp64) average over ranks of the sum of the bf16 micro-batch gradients."""
    torch.manual_seed(0)
    model = Stack(dim=64, layers=2).to(torch.bfloat16)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=1, grad_accum_dtype=accum_dtype, reduce_dtype="fp32"),
                        Comm.from_group(), "cpu", compute_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(100 + rank)
    exact = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in reference.named_parameters()}
    for i in range(micro):
        x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
        reference.zero_grad()
        reference(x).float().sum().backward()
        for n, p in reference.named_parameters():
            exact[n] += p.grad.double()
        context = engine.no_sync() if i < micro - 1 else _null()
        with context:
            engine.backward(model(x).float().sum())
    for n in exact:
        torch.distributed.all_reduce(exact[n])
        exact[n] /= world
    engine.finish_grads()
    worst = 0.0
    for name, param in model.named_parameters():
        unit = engine.unit_of(param)
        piece, span = engine.piece_of(param), unit.spans[next(i for i, p in enumerate(unit.params) if p is param)]
        if piece is None or piece.grad is None:
            continue
        want = exact[name].reshape(-1)[span.param_start:span.param_start + span.length]
        worst = max(worst, float((piece.grad.double() - want).abs().max() / exact[name].abs().max()))
    return {"error": worst}
