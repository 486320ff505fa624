"""User-style LightningModules trained under a strategy; each rank returns what it saw.

Run through ``dist_utils.run_ranks(..., lightning=True)``: every case builds its own Trainer
with ``devices=world``, so one spawn can run DDP and ZeRO back to back on the same data.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torchmetrics
from dist_utils import full_state, trained_state
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import ZeroConfig, ZeroPrecision, ZeroStrategy


def lm_data(n: int = 64, seq: int = 9, vocab: int = 37) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    return DataLoader(TensorDataset(torch.randint(0, vocab, (n, seq), generator=g)), batch_size=4)


class TinyLM(pl.LightningModule):
    """Tied embedding/head, two param groups, a frozen layer, a module used twice, a metric."""

    def __init__(self, vocab: int = 37, dim: int = 24, lr: float = 1e-2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.shared = nn.Linear(dim, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.lr = lr
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=vocab)
        self.losses: list[float] = []
        self.inject_inf_at: set[int] = set()  # (global step) on rank 1 only: fp16 overflow tests
        self.param_trace: list[torch.Tensor] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.fc2(torch.relu(self.fc1(x)))
        x = self.shared(torch.tanh(self.shared(x)))
        return self.head(self.norm(self.frozen(x)))

    def _loss(self, batch) -> torch.Tensor:
        (idx,) = batch
        logits = self(idx[:, :-1])
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        if self.global_step in self.inject_inf_at and self.global_rank == 1:
            loss = loss * math.inf
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # the full state, gathered like a checkpoint would be: stage 3 holds only shards (and
        # returns the full state on rank 0 only)
        if isinstance(self.trainer.strategy, ZeroStrategy):
            weight = full_state(self.trainer).get("norm.weight", torch.zeros(4))
        else:
            weight = self.norm.weight
        self.param_trace.append(weight.detach().float().flatten()[:4].clone())

    def validation_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self(idx[:, :-1])
        self.val_acc(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        self.log("val_acc", self.val_acc)
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0][:, :-1]).float().argmax(-1)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        rest = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=self.lr, betas=(0.9, 0.95))
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


class TinyGAN(pl.LightningModule):
    """Manual optimization with two optimizers (generator and discriminator)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.disc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx + 100 * self.global_rank))
        bce = nn.functional.binary_cross_entropy_with_logits
        self.toggle_optimizer(opt_d)
        fake = self.gen(z).detach()
        d_loss = bce(self.disc(real), torch.ones(real.shape[0], 1)) + bce(self.disc(fake), torch.zeros(real.shape[0], 1))
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.toggle_optimizer(opt_g)
        g_loss = bce(self.disc(self.gen(z)), torch.ones(real.shape[0], 1))
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.losses += [float(d_loss.detach()), float(g_loss.detach())]

    def configure_optimizers(self):
        return [torch.optim.Adam(self.gen.parameters(), lr=1e-2), torch.optim.SGD(self.disc.parameters(), lr=0.05,
                                                                                   momentum=0.9)]


class BNNet(pl.LightningModule):
    """BatchNorm: buffers that every rank updates from its own batch (DDP broadcasts rank 0's)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.losses: list[float] = []
        self.val_losses: list[float] = []  # this rank's: with the running statistics DDP broadcast from rank 0

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), x.sum(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.val_losses.append(float(nn.functional.mse_loss(self.net(x).squeeze(-1), x.sum(-1))))

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 8, generator=torch.Generator().manual_seed(5))), batch_size=4)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


def bn_evaluated_after_fit_case(rank: int, world: int, strategy: str) -> dict:
    """BNNet fitted without validation, then validate / test / predict on the same Trainer: DDP evaluates every rank
    with rank 0's running statistics."""
    pl.seed_everything(0, verbose=False)
    module = BNNet()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=make_strategy(strategy), max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(32, 8, generator=torch.Generator().manual_seed(4))),
                                   batch_size=4))
    trainer.limit_val_batches = 1.0
    trainer.validate(module, module.val_dataloader(), verbose=False)
    out = {"val_losses": list(module.val_losses), "running_mean": module.net[1].running_mean.detach().clone()}
    predicted = trainer.predict(module, DataLoader(TensorDataset(torch.randn(8, 8, generator=torch.Generator()
                                                                              .manual_seed(6))), batch_size=4))
    out["predictions"] = torch.cat([p for p in predicted]) if predicted else None
    return out


def gan_data() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    return DataLoader(TensorDataset(torch.randn(48, 8, generator=g) + 2.0), batch_size=4)


def make_strategy(name: str, **options):
    if name.startswith("ddp") or not name[-1].isdigit():  # "auto", registered names such as "zero_auto"
        return name
    stage = int(name[-1])
    return ZeroStrategy(config=ZeroConfig(stage=stage, reduce_bucket_size=options.pop("bucket", 300), **options))


def fit_case(rank: int, world: int, module_name: str, strategy: str, precision: str = "32-true",
             accumulate: int = 1, clip_val: float = 0.0, clip_algo: str = "norm", epochs: int = 1,
             options: dict | None = None, plugin: str = "", inject: tuple = (), accelerator: str = "cpu",
             probe: bool = True) -> dict:
    """Fit one module under one strategy; returns losses, final full state dict and extras."""
    assert lightning_zero  # registers the names
    pl.seed_everything(0, verbose=False)
    module = {"lm": TinyLM, "blocks": BlockLM, "blocks_reentrant": ReentrantBlockLM,
              "blocks_inout": InOutBlockLM, "blocks_inout_plain": InOutBlockLMNonReentrant, "gan": TinyGAN, "bn": BNNet, "encode": EncodeOnly,
              "rank_expert": RankExpertLM, "blocks_experts": ExpertsLM}[module_name]()
    if inject:
        module.inject_inf_at = set(inject)
    lm = module_name.startswith("blocks") or module_name in ("lm", "rank_expert")
    data = lm_data() if lm else gan_data()
    plugins = [ZeroPrecision(plugin)] if plugin else None
    trainer = pl.Trainer(accelerator=accelerator, devices=world, strategy=make_strategy(strategy, **(options or {})),
                         precision=None if plugin else precision, plugins=plugins, max_epochs=epochs,
                         accumulate_grad_batches=accumulate, gradient_clip_val=clip_val or None,
                         gradient_clip_algorithm=clip_algo if clip_val else None, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, use_distributed_sampler=True,
                         callbacks=[memory := MemoryProbe()] if probe else [])
    trainer.fit(module, data, lm_data(16) if lm else None)
    engine = getattr(trainer.strategy, "engine", None) or getattr(trainer.strategy, "_parked", None)
    offloader = getattr(engine, "offloader", None)
    out = {"losses": module.losses, "global_step": trainer.global_step, "memory": memory.reports if probe else [],
           "stepped_in_backward": offloader.stepped_in_backward if offloader is not None else 0,
           "batches_in_backward": offloader.batches_in_backward if offloader is not None else 0,
           "speculations_undone": offloader.speculations_undone if offloader is not None else 0,
           "host_adds": offloader.host_adds if offloader is not None else 0,
           "offloaded_units": len(offloader.units) if offloader is not None else 0,
           "units": len(engine.units) if engine is not None else 0,
           "speculation_decision": getattr(engine, "speculation_decision", ""),
           "state": trained_state(trainer, module),
           "dtype": str(next(module.parameters()).dtype), "val_losses": getattr(module, "val_losses", [])}
    if lm:
        out["trace"] = torch.stack(module.param_trace)
        out["val"] = {k: float(v) for k, v in trainer.validate(module, lm_data(16), verbose=False)[0].items()}
        preds = trainer.predict(module, lm_data(8))
        out["n_pred"] = sum(p.shape[0] for p in preds)
    if plugin:
        out["scale"] = trainer.precision_plugin.loss_scale
    return out


class RankExpertLM(TinyLM):
    """TinyLM with an expert layer only rank 0 runs: on rank 1 its unit is not fully used, so the ranks step
    different units during backward (offload's overlap) and must still publish alike."""

    def __init__(self) -> None:
        super().__init__()
        self.expert = nn.Linear(24, 24)
        shared = self.shared  # registered again after the expert: the expert's units sit between others
        del self.shared
        self.shared = shared

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.fc2(torch.relu(self.fc1(x)))
        if self.global_rank == 0:  # in the middle: its unit comes between others in backward's order
            x = x + torch.tanh(self.expert(x))
        x = self.shared(torch.tanh(self.shared(x)))
        return self.head(self.norm(self.frozen(x)))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class BlockLM(TinyLM):
    """TinyLM with a stack of blocks (the usual stage-3 group), one of them reused twice."""

    def __init__(self, vocab: int = 37, dim: int = 24, layers: int = 3) -> None:
        super().__init__(vocab, dim)
        del self.fc1, self.fc2
        self.blocks = nn.ModuleList([Block(dim) for _ in range(layers)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        x = self.blocks[0](x)  # a group module called twice in one forward
        x = self.shared(torch.tanh(self.shared(x)))
        logits = self.head(self.norm(self.frozen(x)))
        return logits + 0.0 * self.head.weight.sum()  # a parameter used outside its module's forward


class ReentrantBlockLM(BlockLM):
    """BlockLM whose blocks run under reentrant activation checkpointing (HF's default): each block's forward runs
    again inside backward, with a nested backward of its own."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
        x = self.blocks[0](x)
        x = self.shared(torch.tanh(self.shared(x)))
        logits = self.head(self.norm(self.frozen(x)))
        return logits + 0.0 * self.head.weight.sum()


class InOutBlockLM(BlockLM):
    """A block used both outside and inside a reentrant checkpoint: its gradient comes in two parts, the second after
    the nested backward of the first has already completed the block's units."""

    reentrant = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](self.emb(idx))
        x = torch.utils.checkpoint.checkpoint(lambda z: self.blocks[0](self.blocks[1](z)), x,
                                              use_reentrant=self.reentrant)
        x = self.blocks[2](x)
        logits = self.head(self.norm(self.frozen(self.shared(x))))
        return logits


class InOutBlockLMNonReentrant(InOutBlockLM):
    """The same training with torch's non-reentrant checkpoint: DDP's reference (its reducer refuses a parameter
    that gets a gradient twice in one reentrant backward)."""

    reentrant = False


class ExpertLayer(nn.Module):
    """Top-1 routing over Block experts; rank r may pick only the experts e with (e + r) even, so the ranks run
    different experts in every step (as token routing does on real data)."""

    def __init__(self, dim: int, count: int = 4, name: str = "experts") -> None:
        super().__init__()
        self.router = nn.Linear(dim, count)
        self.name = name
        setattr(self, name, nn.ModuleList([Block(dim) for _ in range(count)]))
        self.rank = 0
        self.same_until = 0  # forwards in which every rank may pick only rank 0's experts
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = getattr(self, self.name)
        gate = self.router(x).softmax(-1)
        rank = 0 if self.calls < self.same_until else self.rank
        self.calls += 1
        allowed = torch.tensor([(e + rank) % 2 == 0 for e in range(len(experts))])
        choice = gate.masked_fill(~allowed, -1.0).argmax(-1)
        out = torch.zeros_like(x)
        for e in choice.unique().tolist():
            picked = choice == e
            out[picked] = experts[e](x[picked]) * gate[picked][:, e:e + 1]
        return x + out


class ExpertsLM(BlockLM):
    """BlockLM with a mixture-of-experts layer between its blocks (experts bigger than min_group_params)."""

    def __init__(self, name: str = "experts") -> None:
        super().__init__()
        self.moe = ExpertLayer(24, name=name)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.moe.rank = self.global_rank
        x = self.emb(idx)
        for i, block in enumerate(self.blocks):
            x = self.moe(block(x)) if i == 1 else block(x)
        x = self.shared(torch.tanh(self.shared(x)))
        return self.head(self.norm(self.frozen(x)))


class BranchesLM(ExpertsLM):
    """ExpertsLM whose experts are called "branches": the size policy cannot tell them from blocks that always run."""

    def __init__(self) -> None:
        super().__init__(name="branches")


def conditional_groups_case(rank: int, world: int) -> dict:
    """BranchesLM under stage 3 with each branch a group of its own: the ranks gather different groups."""
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=world, logger=False, enable_checkpointing=False, max_epochs=1,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         strategy=ZeroStrategy(stage=3, min_group_params=100, param_persistence_threshold=0,
                                               collective_timeout_s=30.0))
    trainer.fit(BranchesLM(), lm_data())
    return {}


def late_conditional_groups_case(rank: int, world: int, prefetch: int) -> dict:
    """BranchesLM whose ranks run the same branches for three steps, then different ones: by then prefetch has
    learned the order, so the ranks' collectives fall out of step inside the step (a rank gathers a branch beside
    the one it prefetched). Returns what each rank raised."""
    pl.seed_everything(0, verbose=False)
    module = BranchesLM()
    module.moe.same_until = 3
    trainer = pl.Trainer(accelerator="cpu", devices=world, logger=False, enable_checkpointing=False, max_epochs=1,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         strategy=ZeroStrategy(stage=3, min_group_params=100, param_persistence_threshold=0,
                                               prefetch=prefetch, collective_timeout_s=5.0))
    try:
        trainer.fit(module, lm_data())
    except Exception as err:  # noqa: BLE001 - the test reads each rank's error
        import traceback
        return {"error": f"{type(err).__name__}: {err}", "step": trainer.global_step, "trace": traceback.format_exc()}
    return {"step": trainer.global_step}


def one_rank_forward_after_fit_case(rank: int, world: int, member: bool = False) -> dict:
    """After a stage-3 fit rank 0 alone runs the module (a quick look under `if trainer.is_global_zero:`);
    ``member``: only a module of the root group, called by itself (as generate() calls an embedding or a head)."""
    from lightning_zero.collectives import MissingRanksError

    pl.seed_everything(0, verbose=False)
    module = BlockLM()
    trainer = pl.Trainer(accelerator="cpu", devices=world, logger=False, enable_checkpointing=False, max_epochs=1,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         strategy=ZeroStrategy(stage=3, wrap_modules=("Block",), param_persistence_threshold=0,
                                               rendezvous_timeout_s=5.0))
    trainer.fit(module, lm_data())
    module.eval()
    out: dict = {"logits": tuple(module(torch.zeros(2, 9, dtype=torch.long)).shape)}  # every rank: runs
    if trainer.is_global_zero:
        try:
            module.eval()
            (module.emb if member else module)(torch.zeros(2, 9, dtype=torch.long))
        except MissingRanksError as err:
            out["error"] = str(err)
    trainer.strategy.barrier()  # rank 1 waited here meanwhile
    return out


class MetaLM(pl.LightningModule):
    """Builds its network in configure_model: on the meta device under zero3."""

    def __init__(self, vocab: int = 37, dim: int = 24, layers: int = 3) -> None:
        super().__init__()
        self.vocab, self.dim, self.layers = vocab, dim, layers
        self.net: nn.Module | None = None
        self.seen: dict = {}

    def configure_model(self) -> None:
        if self.net is None:
            self.net = build_meta_net(self.vocab, self.dim, self.layers)

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self.net(idx[:, :-1])
        return nn.functional.cross_entropy(logits.float().reshape(-1, self.vocab), idx[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def build_meta_net(vocab: int, dim: int, layers: int) -> nn.Module:
    # Modules are created in the order named_modules() lists them: the order materialization replays.
    emb = nn.Embedding(vocab, dim)
    blocks = [Block(dim) for _ in range(layers)]
    norm = nn.LayerNorm(dim)
    head = nn.Linear(dim, vocab, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, *blocks, norm, head)


class MemoryProbe(pl.Callback):
    """Memory report while gradients and optimizer state both exist (just before a step)."""

    def __init__(self) -> None:
        self.reports: list[dict] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step >= 1 and isinstance(trainer.strategy, ZeroStrategy):
            self.reports.append(trainer.strategy.memory_report().as_dict())


class _Probe(pl.Callback):
    def on_fit_start(self, trainer, pl_module):
        import resource

        pl_module.seen["rss_after_setup"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        pl_module.seen["meta_left"] = any(p.is_meta for p in pl_module.parameters())
        # stage 3 returns the full state on rank 0 only; the test reads rank 0's
        pl_module.seen["state"] = {k: v.clone() for k, v in full_state(trainer).items()}
        pl_module.seen["tied"] = pl_module.net[0].weight is pl_module.net[-1].weight


def meta_init_case(rank: int, world: int, dim: int, layers: int) -> dict:
    """Build under zero3 (meta + shard-by-shard), return peak RSS growth and the initial full state."""
    import resource

    pl.seed_everything(0, verbose=False)
    module = MetaLM(dim=dim, layers=layers)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=ZeroStrategy(stage=3, wrap_modules=("Block",)),
                         max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[_Probe()])
    trainer.fit(module, lm_data(8))
    seen = module.seen
    pl.seed_everything(0, verbose=False)
    reference = {f"net.{k}": v for k, v in build_meta_net(37, dim, layers).state_dict().items()}
    full_bytes = sum(v.numel() * 4 for k, v in reference.items() if k != f"net.{layers + 2}.weight")
    return {"rss_growth": seen["rss_after_setup"] - before, "full_bytes": full_bytes, "meta_left": seen["meta_left"],
            "tied": seen["tied"], "state": seen["state"], "reference": reference}


def uneven_eval_case(rank: int, world: int, sharded: bool = True) -> dict:
    """Rank 1 gets one more validation batch than rank 0 (a custom, uneven split); ``sharded=False``: the blocks
    stay gathered (below the persistence threshold), so a forward gathers nothing."""
    pl.seed_everything(0, verbose=False)
    module = BlockLM()
    g = torch.Generator().manual_seed(1)
    val = DataLoader(TensorDataset(torch.randint(0, 37, (8 + 4 * rank, 9), generator=g)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=world, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         strategy=ZeroStrategy(stage=3, wrap_modules=("Block",), collective_timeout_s=6.0,
                                               param_persistence_threshold=0 if sharded else 10**6))
    return trainer.validate(module, val, verbose=False)[0]


class Coder(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.enc = nn.Linear(dim, dim)
        self.dec = nn.Linear(dim, dim)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.enc(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.encode(x))


class EncodeOnly(pl.LightningModule):
    """training_step calls a group's method, not its forward (``self.coder.encode``), then its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.coder = Coder()
        self.head = nn.Linear(16, 1)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        x = torch.cat([x, x], dim=-1)
        z = self.coder.encode(x)
        loss = self.head(z).square().mean() + self.coder(x).square().mean()
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class PlainBlockLM(BlockLM):
    """BlockLM without a torchmetrics metric (metric states cannot be rebuilt after meta init)."""

    def __init__(self) -> None:
        super().__init__()
        del self.val_acc

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)


def init_module_case(rank: int, world: int, with_metric: bool = False) -> dict:
    """``trainer.init_module()`` under zero3: meta parameters, then validate, fit and validate again."""
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=world,
                         strategy=ZeroStrategy(stage=3, wrap_modules=("Block",), real_init_bytes=0),
                         max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with trainer.init_module():
        module = BlockLM() if with_metric else PlainBlockLM()
    on_meta = all(p.is_meta for p in module.parameters())
    first = trainer.validate(module, lm_data(16), verbose=False)[0]
    before = first["val_loss"]
    trainer.fit(module, lm_data())
    after = trainer.validate(module, lm_data(16), verbose=False)[0]["val_loss"]
    shapes = {k: tuple(v.shape) for k, v in trained_state(trainer, module).items()}
    return {"on_meta": on_meta, "before": before, "after": after, "losses": module.losses, "shapes": shapes,
            "val_acc": first.get("val_acc"),
            "reference_shapes": {k: tuple(v.shape) for k, v in PlainBlockLM().state_dict().items()}}
