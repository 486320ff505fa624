"""The parity zoo: the patterns users train with, as LightningModules, for the parity matrix.

Every pattern takes the cell's accumulation (micro-batches per optimizer step) and clipping.
Automatic-optimization patterns hand both to the Trainer; manual ones (GANs, two optimizers,
several backwards) do it by hand the way users write it, with ``self.clip_gradients`` and
``zero_grad`` at the start of each window, so that gradients written by one optimizer's
backward into another's parameters accumulate until their owner clears them (DDP's rule).

No pattern uses dropout, and no parameter gets a gradient that is zero in exact arithmetic
(Adam would turn the rounding noise of such a gradient into full-size steps): what the runs
compare is training, not noise.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, DIM, SEQ = 29, 16, 8
CLIP = 0.3  # small enough that clipping acts at most steps of every pattern
PATTERNS = ("gpt_tied", "gan", "gan_toggle", "shared_loss", "wgan_gp", "lora", "backbone_ft", "add_group", "moe",
            "multi_backward", "schedulers", "hf_gpt2", "batchnorm", "grads_across_steps", "custom_zero_grad",
            "weight_clip", "adagrad", "rmsprop", "torch_clip_gan", "torch_clip_hook")
BF16_PATTERNS = ("gpt_tied", "lora", "moe", "hf_gpt2", "weight_clip", "torch_clip_hook")  # bf16-mixed where it means something: token models
EPOCHS = {"backbone_ft": 2, "add_group": 2, "schedulers": 2}
LR_SCALE = 1.0  # the negative control of the 16-bit bound trains gpt_tied with a learning rate slightly off
GRAD_SCALE = 1.0  # the fp32 bound's: gpt_tied's gradients slightly too large (its hyperparameters stay equal)


def token_data(n: int = 48) -> DataLoader:
    g = torch.Generator().manual_seed(11)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)), batch_size=4)


def point_data(n: int = 48, dim: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    return DataLoader(TensorDataset(torch.randn(n, dim, generator=g) + 1.5), batch_size=4)


def lm_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


# ---- building blocks ---------------------------------------------------------------------------------
class Attention(nn.Module):
    """Causal self-attention whose mask is a buffer (buffers travel with the module)."""

    def __init__(self, dim: int = DIM, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a key bias would get an exactly-zero gradient
        self.out = nn.Linear(dim, dim)
        self.register_buffer("mask", torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int = DIM, lora: int = 0) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.lora_a = nn.Parameter(torch.randn(lora, dim) * 0.2) if lora else None
        self.lora_b = nn.Parameter(torch.randn(dim, lora) * 0.2) if lora else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        h = self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))
        if self.lora_a is not None:
            h = h + x @ self.lora_a.t() @ self.lora_b.t()
        return x + h


class TinyGPT(nn.Module):
    """Token and position embeddings, blocks, a head tied to the token embedding."""

    def __init__(self, layers: int = 2, lora: int = 0) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.register_buffer("positions", torch.arange(SEQ), persistent=False)
        self.blocks = nn.ModuleList([Block(lora=lora) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(self.positions[: idx.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ---- automatic optimization ------------------------------------------------------------------------
class Pattern(pl.LightningModule):
    """Shared bookkeeping: every logged loss, in order, on this rank."""

    data = staticmethod(token_data)

    def __init__(self, accumulate: int = 1, clip: bool = False) -> None:
        super().__init__()
        self.accumulate, self.clip = accumulate, clip
        self.losses: list[float] = []

    def record(self, *losses: torch.Tensor) -> None:
        self.losses += [float(x.detach()) for x in losses]


class GPTTied(Pattern):
    def __init__(self, **cell) -> None:
        super().__init__(**cell)
        self.model = TinyGPT()

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        loss = lm_loss(self.model(idx[:, :-1]), idx)
        self.record(loss)
        return loss * GRAD_SCALE if GRAD_SCALE != 1.0 else loss

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        rest = [p for n, p in self.named_parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=3e-3 * LR_SCALE, betas=(0.9, 0.95))


class LoRA(GPTTied):
    """A frozen base with trainable low-rank adapters."""

    def __init__(self, **cell) -> None:
        Pattern.__init__(self, **cell)
        self.model = TinyGPT(lora=2)
        for name, p in self.model.named_parameters():
            p.requires_grad_("lora_" in name)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)


class BackboneFT(Pattern):
    """Lightning's BackboneFinetuning; the optimizer is built from the parameters trainable at setup."""

    def __init__(self, **cell) -> None:
        super().__init__(**cell)
        self.backbone = nn.Sequential(nn.Embedding(VOCAB, DIM), Block(), Block())
        self.head = nn.Linear(DIM, VOCAB)

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        loss = lm_loss(self.head(self.backbone(idx[:, :-1])), idx)
        self.record(loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=3e-3)

    def callbacks(self) -> list:
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)]


class AddGroup(BackboneFT):
    """A user callback unfreezes the backbone at epoch 1 and adds it as a group with its own lr, betas and
    weight decay to an optimizer that was built from a filter."""

    def __init__(self, **cell) -> None:
        super().__init__(**cell)
        self.backbone.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=3e-3, weight_decay=0.05)

    def callbacks(self) -> list:
        return [_UnfreezeByHand()]


class _UnfreezeByHand(pl.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.backbone.requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": list(pl_module.backbone.parameters()), "lr": 1e-3,
                                                   "betas": (0.8, 0.99), "weight_decay": 0.0})


class MoE(Pattern):
    """Conditional computation: expert 0 always runs, expert 1 on rank 0 only, expert 2 never."""

    def __init__(self, **cell) -> None:
        super().__init__(**cell)
        self.wte = nn.Embedding(VOCAB, DIM)
        self.experts = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(3)])
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        x = self.wte(idx[:, :-1])
        x = x + torch.tanh(self.experts[0](x))
        if self.global_rank == 0:
            x = x + torch.tanh(self.experts[1](x))
        loss = lm_loss(self.head(self.ln(x)), idx)
        self.record(loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=5e-3, weight_decay=0.1)


class Schedulers(GPTTied):
    """A per-step warmup and a per-epoch decay on one optimizer."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=5e-3)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
        decay = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return [opt], [{"scheduler": warmup, "interval": "step"}, {"scheduler": decay, "interval": "epoch"}]


class HFGPT2(Pattern):
    """A Hugging Face GPT-2 (tied embeddings, its own buffers), built from a config."""

    def __init__(self, **cell) -> None:
        super().__init__(**cell)
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_layer=2, n_embd=DIM, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        loss = self.model(input_ids=idx[:, :-1], labels=idx[:, :-1]).loss
        self.record(loss)
        return loss

    def configure_optimizers(self):
        # eps: attention's key bias gets a gradient that is zero in exact arithmetic (see the module docstring)
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-6)


class BatchNorm(Pattern):
    """Buffers every rank updates from its own batch (DDP broadcasts rank 0's before each forward)."""

    data = staticmethod(point_data)

    def __init__(self, **cell) -> None:
        super().__init__(**cell)
        # no bias before the norm: its gradient would be zero in exact arithmetic (the norm removes it)
        self.net = nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), x.sum(-1))
        self.record(loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


# ---- manual optimization ---------------------------------------------------------------------------
class Manual(Pattern):
    """Accumulation and clipping done by hand: ``begin`` at a window's first micro-batch, ``end`` at its last."""

    def __init__(self, **cell) -> None:
        super().__init__(**cell)
        self.automatic_optimization = False

    def begin(self, batch_idx: int) -> bool:
        return batch_idx % self.accumulate == 0

    def end(self, batch_idx: int) -> bool:
        return (batch_idx + 1) % self.accumulate == 0

    def backward_scaled(self, loss: torch.Tensor, **kwargs) -> None:
        self.manual_backward(loss / self.accumulate, **kwargs)

    def clipped_step(self, opt) -> None:
        if self.clip:
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        opt.step()

    def train_on(self, opt, loss: torch.Tensor, batch_idx: int) -> None:
        """``opt.zero_grad()`` at a window's start, backward, step at its end: what users write."""
        if self.begin(batch_idx):
            opt.zero_grad()
        self.backward_scaled(loss)
        if self.end(batch_idx):
            self.clipped_step(opt)


class GAN(Manual):
    """Generator and discriminator; the generator's loss also writes the discriminator's gradients."""

    data = staticmethod(point_data)
    toggle = False

    def __init__(self, **cell) -> None:
        super().__init__(**cell)
        self.gen = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.disc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def noise(self, n: int, batch_idx: int) -> torch.Tensor:
        return torch.randn(n, 4, generator=torch.Generator().manual_seed(batch_idx + 100 * self.global_rank))

    def training_step(self, batch, batch_idx):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        fake = self.gen(self.noise(real.shape[0], batch_idx))
        with self._toggled(opt_d):
            d_loss = (nn.functional.softplus(-self.disc(real)).mean()
                      + nn.functional.softplus(self.disc(fake.detach())).mean())
            self.train_on(opt_d, d_loss, batch_idx)
        with self._toggled(opt_g):
            g_loss = nn.functional.softplus(-self.disc(fake)).mean()  # also writes the discriminator's gradients
            self.train_on(opt_g, g_loss, batch_idx)
        self.record(d_loss, g_loss)

    def _toggled(self, opt):
        module = self

        class Toggle:
            def __enter__(self):
                if module.toggle:
                    module.toggle_optimizer(opt)

            def __exit__(self, *exc):
                if module.toggle:
                    module.untoggle_optimizer(opt)

        return Toggle()

    def configure_optimizers(self):
        return [torch.optim.Adam(self.gen.parameters(), lr=1e-2, betas=(0.5, 0.999)),
                torch.optim.Adam(self.disc.parameters(), lr=2e-2, betas=(0.5, 0.999))]


class GANToggle(GAN):
    toggle = True


class SharedLoss(Manual):
    """Two optimizers (body and head) stepping on one loss."""

    def __init__(self, **cell) -> None:
        super().__init__(**cell)
        self.body = nn.Sequential(nn.Embedding(VOCAB, DIM), Block())
        self.head = nn.Linear(DIM, VOCAB)

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        body_opt, head_opt = self.optimizers()
        loss = lm_loss(self.head(self.body(idx[:, :-1])), idx)
        if self.begin(batch_idx):
            body_opt.zero_grad()
            head_opt.zero_grad()
        self.backward_scaled(loss)
        if self.end(batch_idx):
            self.clipped_step(body_opt)
            self.clipped_step(head_opt)
        self.record(loss)

    def configure_optimizers(self):
        return [torch.optim.AdamW(self.body.parameters(), lr=5e-3), torch.optim.SGD(self.head.parameters(), lr=0.1,
                                                                                   momentum=0.9)]


class WGANGP(GAN):
    """WGAN-GP: the critic's loss holds a gradient penalty (``create_graph=True``, a double backward)."""

    def __init__(self, **cell) -> None:
        super().__init__(**cell)
        self.disc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))  # twice differentiable

    def training_step(self, batch, batch_idx):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        fake = self.gen(self.noise(real.shape[0], batch_idx))
        mix = torch.rand(real.shape[0], 1, generator=torch.Generator().manual_seed(batch_idx))
        interp = (mix * real + (1 - mix) * fake.detach()).requires_grad_(True)
        (grad,) = torch.autograd.grad(self.disc(interp).sum(), interp, create_graph=True)
        penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
        d_loss = self.disc(fake.detach()).mean() - self.disc(real).mean() + 10.0 * penalty
        self.train_on(opt_d, d_loss, batch_idx)
        g_loss = -self.disc(fake).mean()
        self.train_on(opt_g, g_loss, batch_idx)
        self.record(d_loss, g_loss)

    def configure_optimizers(self):
        return [torch.optim.Adam(self.gen.parameters(), lr=5e-3, betas=(0.0, 0.9)),
                torch.optim.Adam(self.disc.parameters(), lr=5e-3, betas=(0.0, 0.9))]


class MultiBackward(Manual):
    """Two losses back-propagated separately through one graph (``retain_graph=True``) before one step."""

    def __init__(self, **cell) -> None:
        super().__init__(**cell)
        self.model = TinyGPT()
        self.aux = nn.Linear(VOCAB, 1)

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        opt = self.optimizers()
        logits = self.model(idx[:, :-1])
        main = lm_loss(logits, idx)
        aux = self.aux(logits).pow(2).mean()  # through the same graph as the main loss
        if self.begin(batch_idx):
            opt.zero_grad()
        self.backward_scaled(main, retain_graph=True)
        self.backward_scaled(0.5 * aux)
        if self.end(batch_idx):
            self.clipped_step(opt)
        self.record(main, aux)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class GradsAcrossSteps(Manual):
    """Gradients kept across steps: ``zero_grad`` only every other optimizer step, so each second step
    uses the gradients of both windows (DDP keeps them; a step must not drop them)."""

    def __init__(self, **cell) -> None:
        super().__init__(**cell)
        self.model = TinyGPT()

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        opt = self.optimizers()
        loss = lm_loss(self.model(idx[:, :-1]), idx)
        if batch_idx % (2 * self.accumulate) == 0:
            opt.zero_grad()
        self.backward_scaled(loss)
        if self.end(batch_idx):
            self.clipped_step(opt)
        self.record(loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class CustomZeroGrad(GPTTied):
    """Automatic optimization with ``optimizer_zero_grad`` overridden to zero only every other step."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if (batch_idx // self.accumulate) % 2 == 0:
            optimizer.zero_grad()


class WeightClip(GPTTied):
    """A WGAN critic's weight clipping: after each step every matrix is clamped in place (``p.data.clamp_`` and
    ``p.clamp_`` under no_grad, the two ways people write it); the next step starts from the clamped values."""

    BOUND = 0.03  # the initial weights (std 0.02) already reach it: the clamp acts from the first step

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            for k, p in enumerate(q for q in self.parameters() if q.dim() >= 2):
                (p.data if k % 2 else p).clamp_(-self.BOUND, self.BOUND)


class AdagradGPT(GPTTied):
    """Adagrad (its constructor already fills state: ``sum`` and ``step``), with lr decay and a start value."""

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1,
                                   weight_decay=0.01)


class RMSpropGPT(GPTTied):
    def configure_optimizers(self):
        return torch.optim.RMSprop(self.parameters(), lr=3e-3, centered=True, momentum=0.9, weight_decay=0.01)


class TorchClipGAN(GAN):
    """The GAN clipped with torch's own functions where ``self.clip_gradients`` was: ``clip_grad_norm_`` over the
    discriminator's parameters, ``clip_grad_value_`` over the generator's (the generator's loss also wrote the
    discriminator's gradients: the discriminator's clip sees them)."""

    def clipped_step(self, opt) -> None:
        if self.clip:
            g_opt, _ = self.optimizers()
            if opt is g_opt:
                torch.nn.utils.clip_grad_value_(self.gen.parameters(), CLIP / 10)
            else:
                torch.nn.utils.clip_grad_norm_(self.disc.parameters(), CLIP)
        opt.step()


class TorchClipHook(GPTTied):
    """Automatic optimization clipped in ``on_before_optimizer_step`` with ``torch.nn.utils.clip_grad_norm_`` over
    ``self.parameters()`` (instead of the Trainer's ``gradient_clip_val``: ``own_clipping``)."""

    own_clipping = True

    def on_before_optimizer_step(self, optimizer):
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP)


CLASSES = {"gpt_tied": GPTTied, "gan": GAN, "gan_toggle": GANToggle, "shared_loss": SharedLoss, "wgan_gp": WGANGP,
           "lora": LoRA, "backbone_ft": BackboneFT, "add_group": AddGroup, "moe": MoE,
           "multi_backward": MultiBackward, "schedulers": Schedulers, "hf_gpt2": HFGPT2, "batchnorm": BatchNorm,
           "grads_across_steps": GradsAcrossSteps, "custom_zero_grad": CustomZeroGrad, "weight_clip": WeightClip,
           "adagrad": AdagradGPT, "rmsprop": RMSpropGPT, "torch_clip_gan": TorchClipGAN,
           "torch_clip_hook": TorchClipHook}
assert set(CLASSES) == set(PATTERNS)


def build(pattern: str, accumulate: int, clip: bool) -> Pattern:
    return CLASSES[pattern](accumulate=accumulate, clip=clip)
