"""A small GPT decoder as a LightningModule: the model the Hydra app trains.

Pre-LN blocks, causal scaled-dot-product attention, a 4x GELU MLP, learned positions and an
optional tied embedding / lm_head. Every parameter-owning module initializes its own weights in
``reset_parameters``, so a model built on the meta device (``with torch.device("meta")``, or in
``configure_model`` under a strategy's init context) can be materialized with ``to_empty`` +
``reset_parameters`` and holds exactly the values an eagerly built one would.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.text import Perplexity

from . import check_settings

__all__ = ["GPT", "GPTModule", "Block", "CausalSelfAttention", "MLP", "Linear", "Embedding", "param_groups",
           "warmup_cosine"]

INIT_STD = 0.02  # GPT-2's init; residual projections are further scaled by 1/sqrt(2 * n_layer)

# [Note: where the initialization lives]
# A model built on the meta device is materialized module by module: each module that owns
# parameters gets memory (``to_empty(recurse=False)``) and then runs its own
# ``reset_parameters()``, in ``named_modules`` order, replaying the random state of construction
# time (that is how lightning_zero's stage 3 builds a model shard by shard). So the GPT-2 init is
# put on the parameter-owning modules themselves (``Linear``/``Embedding`` below), and the
# container modules consume no random numbers in ``__init__``: an eager model and a materialized
# meta model built after the same seed then hold identical values.


class Linear(nn.Linear):
    """``nn.Linear`` initialized as GPT-2: weight ~ N(0, std), bias 0."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = INIT_STD) -> None:
        self.std = std  # set first: nn.Linear.__init__ calls reset_parameters
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` initialized as GPT-2: N(0, std) (torch's default is N(0, 1))."""

    def __init__(self, num_embeddings: int, embedding_dim: int, std: float = INIT_STD) -> None:
        self.std = std
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``.

    Args:
        d_model: width of the residual stream; must be divisible by ``n_head``.
        n_head: number of attention heads.
        dropout: attention and residual dropout probability (training only).
        residual_std: init std of the output projection (scaled down for depth).
    """

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0, residual_std: float = INIT_STD) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model={d_model} must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = Linear(d_model, 3 * d_model)
        self.proj = Linear(d_model, d_model, std=residual_std)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        # (B, T, 3C) -> three (B, H, T, C/H) tensors, the layout SDPA expects.
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    """The position-wise 4x feed-forward network with GELU."""

    def __init__(self, d_model: int, dropout: float = 0.0, residual_std: float = INIT_STD) -> None:
        super().__init__()
        self.fc = Linear(d_model, 4 * d_model)
        self.proj = Linear(4 * d_model, d_model, std=residual_std)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """One pre-LN decoder block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.

    Its class name is what ``ZeroConfig.wrap_modules`` / ``activation_checkpointing`` refer to
    (``strategy.wrap_modules=[Block]``).
    """

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0, residual_std: float = INIT_STD) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout, residual_std)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout, residual_std)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, a final LayerNorm and the lm_head.

    Args:
        vocab_size: number of token ids.
        seq_len: the longest sequence (size of the learned position table).
        n_layer, n_head, d_model: depth, heads per block, width.
        dropout: dropout probability everywhere (0 for the deterministic tests).
        tie_embeddings: share one matrix between the token embedding and the lm_head.
    """

    def __init__(self, vocab_size: int, seq_len: int, n_layer: int = 4, n_head: int = 4, d_model: int = 256,
                 dropout: float = 0.0, tie_embeddings: bool = True) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tie_embeddings = tie_embeddings
        residual_std = INIT_STD / math.sqrt(2 * n_layer)  # keeps the residual stream's variance flat with depth
        self.tok_emb = Embedding(vocab_size, d_model)
        self.pos_emb = Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout, residual_std) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = Linear(d_model, vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make the lm_head use the embedding matrix (again after ``to_empty``, which unties shared tensors)."""
        if self.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def reset_parameters(self) -> None:
        """Re-initialize every parameter once, by its first owner in ``named_modules`` order.

        After ``to_empty`` this reproduces the eager model built after the same seed (see the note above).
        """
        self.tie_weights()
        seen: set[int] = set()
        for module in self.modules():
            own = list(module.parameters(recurse=False))
            if own and not all(id(p) in seen for p in own):  # a tied lm_head is the embedding: skip it
                module.reset_parameters()
            seen.update(id(p) for p in own)

    def num_params(self) -> int:
        """Distinct parameters (a tied matrix counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``(B, T, vocab)`` for token ids ``idx`` of shape ``(B, T)``, ``T <= seq_len``."""
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of length {t} is longer than seq_len={self.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay matrices of Linear layers only; norms, biases and embeddings are not decayed.

    Decaying a LayerNorm gain or a bias pulls it towards 0 for no regularization benefit, and
    embeddings are lookup tables whose rows see few updates. A tied lm_head is the embedding matrix,
    so it lands in the no-decay group (parameters are classified once, by their first owner).
    """
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            is_matrix = isinstance(module, nn.Linear) and name == "weight"
            (decay if is_matrix else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """LR multiplier: linear warmup to 1, then a cosine decay to ``min_ratio`` at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class GPTModule(pl.LightningModule):
    """Next-token language modelling with :class:`GPT`.

    Args:
        vocab_size, seq_len, n_layer, n_head, d_model, dropout, tie_embeddings: the :class:`GPT` shape.
        lr: peak learning rate of AdamW.
        weight_decay: decay of the Linear matrices (see :func:`param_groups`).
        betas: AdamW betas.
        warmup_steps: linear warmup before the cosine decay.
        min_lr_ratio: the cosine ends at ``lr * min_lr_ratio``.
        build_in_configure_model: build the layers in ``configure_model`` instead of ``__init__``, i.e.
            inside the strategy's init context (meta device / stage-3 partitioning at construction).
    """

    def __init__(self, vocab_size: int, seq_len: int = 64, n_layer: int = 4, n_head: int = 4, d_model: int = 256,
                 dropout: float = 0.0, tie_embeddings: bool = True, lr: float = 3e-3, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 30, min_lr_ratio: float = 0.1,
                 build_in_configure_model: bool = False) -> None:
        positive = "a whole number of 1 or more"
        check_settings("model", {
            "seq_len": (seq_len, isinstance(seq_len, int) and seq_len >= 1, positive),
            "n_layer": (n_layer, isinstance(n_layer, int) and n_layer >= 1, positive),
            "n_head": (n_head, isinstance(n_head, int) and n_head >= 1, positive),
            "d_model": (d_model, isinstance(d_model, int) and d_model >= 1 and d_model % max(1, int(n_head)) == 0,
                        f"a whole number that model.n_head={n_head} divides"),
            "dropout": (dropout, 0.0 <= dropout < 1.0, "in [0, 1)"),
            "lr": (lr, lr > 0, "above 0"),
            "warmup_steps": (warmup_steps, isinstance(warmup_steps, int) and warmup_steps >= 0, "a whole number of 0 or more"),
            "min_lr_ratio": (min_lr_ratio, 0.0 <= min_lr_ratio <= 1.0, "in [0, 1]")})
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[GPT] = None if build_in_configure_model else self._build()
        with torch.device("meta"):  # the full count, whatever a strategy later shards or offloads
            self.n_params = self._build().num_params()
        self.flops_per_batch = 0  # read by Lightning's ThroughputMonitor, set per batch in training_step
        # Token-weighted perplexity over the whole validation set, synced across ranks by torchmetrics.
        self.val_ppl = Perplexity()

    def _build(self) -> GPT:
        h = self.hparams
        return GPT(h.vocab_size, h.seq_len, h.n_layer, h.n_head, h.d_model, h.dropout, h.tie_embeddings)

    def configure_model(self) -> None:
        if self.model is None:  # idempotent: Lightning may call it more than once (fit, then validate)
            self.model = self._build()

    def forward(self, idx: Tensor) -> Tensor:
        assert self.model is not None, "the model is built in configure_model(): run it through a Trainer first"
        return self.model(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = batch
        logits = self(x)
        # The loss is computed in fp32 whatever the compute dtype (bf16 log-softmax loses digits).
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        return loss, logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        # 6 N FLOPs per token (forward + backward, recomputation not counted). Lightning's Throughput
        # divides this figure by the world size to get the per-device rate, so it is the global batch's.
        world = self.trainer.world_size if self._trainer is not None else 1
        self.flops_per_batch = 6 * self.n_params * batch[0].numel() * world
        loss, _ = self._loss(batch)
        self.log("train/loss", loss, on_step=True, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        self.log("val/loss", loss, on_epoch=True, prog_bar=True, sync_dist=True)
        self.val_ppl(logits.float(), batch[1])
        self.log("val/ppl", self.val_ppl, on_epoch=True)

    def configure_optimizers(self) -> dict[str, Any]:
        h = self.hparams
        optimizer = torch.optim.AdamW(param_groups(self, h.weight_decay), lr=h.lr, betas=tuple(h.betas))
        total = int(self.trainer.estimated_stepping_batches)
        # Short runs (smoke tests with max_steps=4) would otherwise spend every step warming up.
        warmup = min(h.warmup_steps, max(1, total // 10))
        schedule = warmup_cosine(warmup, total, h.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
                 generator: Optional[torch.Generator] = None) -> Tensor:
        """Sample ``max_new_tokens`` continuations of ``idx`` ``(B, T)``; the context is cropped to ``seq_len``."""
        was_training = self.training
        self.eval()
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.hparams.seq_len:])[:, -1, :].float() / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        self.train(was_training)
        return idx
