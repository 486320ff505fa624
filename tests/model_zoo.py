"""The models people train, as LightningModules, with memory probes inside them.

Each model is a stack of ``Block`` groups around a root (embedding, norm, head). The probes
run in hooks of the user's own modules and read what is really alive:
- gathered blocks: blocks whose parameters point at storage with bytes (stage 3 frees the rest);
- full gradient buffers: live tensors (found by ``gc``) the size of a gradient bucket that are
  not parameter storage (stages 1/2).
"""

from __future__ import annotations

import gc

import lightning.pytorch as pl
import torch
from dist_utils import trained_state
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import ZeroConfig, ZeroPrecision, ZeroStrategy

VOCAB, DIM, LAYERS = 37, 32, 8


def zoo_data(n: int = 32, seq: int = 9) -> DataLoader:
    g = torch.Generator().manual_seed(11)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (n, seq), generator=g)), batch_size=4)


class Block(nn.Module):
    def __init__(self, dim: int = DIM, rank: int = 0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) * 0.1) if rank else None
        self.lora_b = nn.Parameter(torch.randn(dim, rank) * 0.1) if rank else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.ln(x))
        out = self.fc2(nn.functional.gelu(h))
        if self.lora_a is not None:
            out = out + x @ self.lora_a.t() @ self.lora_b.t()
        return x + out


class MoE(nn.Module):
    """Experts picked per rank and per batch; the last expert is never picked."""

    def __init__(self, dim: int = DIM, experts: int = 4) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(dim, dim) for _ in range(experts)])

    def forward(self, x: torch.Tensor, choice: int) -> torch.Tensor:
        return x + torch.tanh(self.experts[choice](x))


class ZooLM(pl.LightningModule):
    """kind: plain | lora | unused | stem | moe."""

    def __init__(self, kind: str = "plain", lr: float = 1e-2, weight_decay: float = 0.1) -> None:
        super().__init__()
        self.kind, self.lr, self.weight_decay = kind, lr, weight_decay
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(rank=4 if kind == "lora" else 0) for _ in range(LAYERS)])
        if kind == "stem":  # registered after the blocks, run before them
            self.stem = Block()
        if kind == "moe":
            self.moe = MoE()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if kind == "lora":
            for name, p in self.named_parameters():
                p.requires_grad_("lora_" in name)
        self.losses: list[float] = []
        self.probe = False
        self.seen_blocks: list[int] = []  # blocks whose parameters point at memory, per probe point
        self.seen_buffers: list[dict[str, int]] = []  # unit-sized flat buffers alive, by dtype
        self.unit_numels: set[int] = set()
        self._hooks: list = []

    # ---- probes -------------------------------------------------------------------------
    def arm_probes(self, unit_numels: set[int]) -> None:
        self.probe, self.unit_numels = True, unit_numels
        gc.collect()  # earlier runs in this process: only what is still reachable counts
        for block in self.blocks:
            self._hooks += [block.register_forward_pre_hook(lambda m, a: self._measure()),
                            block.register_full_backward_pre_hook(lambda m, g: self._measure()),
                            block.register_full_backward_hook(lambda m, gi, go: self._measure())]

    def _measure(self) -> None:
        if not self.training or self.global_step != 1:  # gc scans are slow: one step after the first shows it
            return
        self.seen_blocks.append(sum(1 for b in self.blocks
                                    if any(p.untyped_storage().nbytes() > 0 for p in b.parameters())))
        self.seen_buffers.append(self._full_size_buffers())

    def _full_size_buffers(self) -> dict[str, int]:
        """Distinct live storages of unit-sized flat tensors, by dtype (run with fp32 parameters and a
        bf16 reduce dtype, fp32 ones are gathered parameters and bf16 ones gradient buffers)."""
        found: dict[int, str] = {}
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.dim() == 1 and obj.numel() in self.unit_numels:
                storage = obj.untyped_storage()
                if storage.nbytes() > 0:
                    found[storage.data_ptr()] = str(obj.dtype).replace("torch.", "")
        counts: dict[str, int] = {}
        for dtype in found.values():
            counts[dtype] = counts.get(dtype, 0) + 1
        return counts

    # ---- the model ------------------------------------------------------------------------
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        if self.kind == "stem":
            x = self.stem(x)
        for i, block in enumerate(self.blocks):
            if self.kind == "unused" and i == 3:
                continue  # a trainable layer forward never uses
            x = block(x)
            if self.kind == "moe" and i == LAYERS // 2:
                x = self.moe(x, (self.global_step + self.global_rank + idx.shape[0]) % 3)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self(idx[:, :-1])
        self.log("val_loss", nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), idx[:, 1:].reshape(-1)),
                 sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr,
                                 weight_decay=self.weight_decay)


def zoo_strategy(name: str, kind: str = "plain", backend: str | None = None, **options):
    if name.startswith("ddp"):
        if backend is None:
            return name
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend=backend, find_unused_parameters="unused" in name)
    if name == "zero_auto":
        return ZeroStrategy(config=name, process_group_backend=backend, **options)
    stage = int(name[-1])
    if stage == 3:  # MoE: the layer that always runs is the group, not each expert
        options.setdefault("wrap_modules", ("Block", "MoE") if kind == "moe" else ("Block",))
        options.setdefault("param_persistence_threshold", 0)
    options.setdefault("reduce_bucket_size", 4000)  # about one block per bucket
    return ZeroStrategy(config=ZeroConfig(stage=stage, **options), process_group_backend=backend)


class _ArmProbes(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        engine = getattr(trainer.strategy, "engine", None)
        # the sizes of the flat units (a layout fact); what is alive is found by gc, not asked of the engine
        # (stage 3: without the root group's unit, which the strategy holds for the whole step)
        root = {id(p) for p in pl_module.emb.parameters()} if engine.config.stage == 3 else set()
        sizes = {u.layout.padded_numel for u in engine.units if not any(id(p) in root for p in u.params)}
        pl_module.arm_probes(sizes)


def fit_zoo(rank: int, world: int, kind: str, strategy: str, probe: bool = False, accumulate: int = 1,
            options: dict | None = None, epochs: int = 1, one_gpu: bool = False, precision: str = "32-true",
            plugin: str = "") -> dict:
    """``one_gpu``: every rank on cuda:0 as one "node" each, over gloo (see dist_utils.run_ranks)."""
    assert lightning_zero
    pl.seed_everything(0, verbose=False)
    module = ZooLM(kind)
    where = dict(accelerator="gpu", devices=1, num_nodes=world) if one_gpu else dict(accelerator="cpu", devices=world)
    strategy_obj = zoo_strategy(strategy, kind, backend="gloo" if one_gpu else None, **(options or {}))
    trainer = pl.Trainer(**where, strategy=strategy_obj, max_epochs=epochs, accumulate_grad_batches=accumulate,
                         precision=None if plugin else precision, plugins=[ZeroPrecision(plugin)] if plugin else None,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[_ArmProbes()] if probe else [])
    trainer.fit(module, zoo_data())
    out = {"losses": module.losses, "global_step": trainer.global_step,
           "state": trained_state(trainer, module)}
    auto = getattr(trainer.strategy, "_auto", None)
    out["measured"] = auto.replanner.measured if auto is not None else None  # zero_auto's first-step figure
    if one_gpu:
        out["val"] = trainer.validate(module, zoo_data(16), verbose=False)[0]
    if probe:
        out.update(seen_blocks=module.seen_blocks, seen_buffers=module.seen_buffers)
    return out


def fit_zoo_many(rank: int, world: int, runs: dict) -> dict:
    return {name: fit_zoo(rank, world, *args, **kwargs) for name, (args, kwargs) in runs.items()}


class LiveBytes(pl.Callback):
    """Before a step (gradients and optimizer state both alive): every live CPU tensor storage in the
    process, found by ``gc``, beside the strategy's memory report — an independent measurement."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step < 1:
            return
        gc.collect()
        storages: dict[int, int] = {}
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        report = trainer.strategy.memory_report().as_dict()
        self.seen.append({"live": sum(storages.values()), "report": report})


def live_bytes_case(rank: int, world: int, stage: int) -> dict:
    assert lightning_zero
    pl.seed_everything(0, verbose=False)
    module = ZooLM("plain")
    probe = LiveBytes()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=zoo_strategy(f"zero{stage}"), max_steps=3,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[probe])
    trainer.fit(module, zoo_data())
    return {"seen": probe.seen}
