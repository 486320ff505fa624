"""A Hugging Face GPT-2 with reentrant gradient checkpointing, under the engine API and under DDP
(tests/test_hf.py)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel

import lightning_zero

MICRO_BATCHES = 8  # accumulation 2: four optimizer steps
# Attention's key bias gets a gradient that is zero in exact arithmetic (softmax ignores a shift):
# Adam with eps=1e-8 turns its rounding noise, which depends on the order of the sums, into full-size
# steps. eps=1e-6 keeps the noise small and leaves every real gradient's update as it was.
EPS = 1e-6


def _model(checkpointing: bool) -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=96, n_positions=16, n_layer=2, n_embd=32, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: runs compare exactly
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    return model


def _micro_batches(rank: int, world: int) -> list[torch.Tensor]:
    """This rank's first MICRO_BATCHES batches of 4 token windows, in the same order for every run."""
    data = torch.randint(0, 96, (64, 16), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, world, rank, shuffle=False))
    return list(loader)[:MICRO_BATCHES]


def ddp_reference(rank: int, world: int) -> dict:
    """Plain DDP, no checkpointing: the numbers every stage must reproduce."""
    model = DDP(_model(checkpointing=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, eps=EPS)
    losses = []
    for i, batch in enumerate(_micro_batches(rank, world)):
        boundary = (i + 1) % 2 == 0
        with (model.no_sync() if not boundary else torch.enable_grad()):
            loss = model(input_ids=batch, labels=batch).loss
            (loss / 2).backward()
        losses.append(float(loss))
        if boundary:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    return {"state": {k: v.detach().clone() for k, v in model.module.state_dict().items()}, "losses": losses}


def engine_run(rank: int, world: int, stage: int) -> dict:
    model = _model(checkpointing=True)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                    "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "eps": EPS}}}
    engine, _, _, _ = lightning_zero.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    for batch in _micro_batches(rank, world):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    state = engine.full_state_dict(rank0_only=False)
    tied = model.lm_head.weight is model.transformer.wte.weight
    return {"state": state, "losses": losses, "tied": tied, "steps": engine.global_steps}
