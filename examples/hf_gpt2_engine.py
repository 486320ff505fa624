"""A Hugging Face GPT-2 trained with lightning_zero's DeepSpeed-style engine API.

    torchrun --nproc_per_node 2 examples/hf_gpt2_engine.py --deepspeed_config examples/ds_config_gpt2.json
    torchrun --nproc_per_node 2 examples/hf_gpt2_engine.py --tiny --out /tmp/gpt2-trained   # CPU smoke run

The model is built from a ``GPT2Config`` (no download); the data are random token windows. Needs
``pip install transformers`` (the ``hf`` extra). At the end rank 0 writes ``save_pretrained`` from the
consolidated fp32 weights: ``GPT2LMHeadModel.from_pretrained(out)`` loads it without lightning_zero.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import lightning_zero

DEFAULT_CONFIG = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": 5e5},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 10,
                                                 "warmup_type": "linear"}},
}


class Windows(torch.utils.data.Dataset):
    """Random token windows with a learnable pattern (each token repeats the one two places back)."""

    def __init__(self, vocab: int, length: int, count: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (count, length), generator=g)
        self.data[:, 2:] = self.data[:, :-2].clone()  # learnable: a copy of two tokens earlier

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspeed_config", help="ds_config.json (default: stage 3, AdamW, WarmupLR)")
    ap.add_argument("--tiny", action="store_true", help="2 layers x 64: a CPU smoke run")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--checkpointing", action="store_true", help="HF gradient checkpointing (reentrant)")
    ap.add_argument("--out", help="save_pretrained directory (rank 0)")
    args = ap.parse_args()
    size = dict(n_layer=2, n_embd=64, n_head=2) if args.tiny else dict(n_layer=12, n_embd=768, n_head=12)
    config = GPT2Config(vocab_size=256, n_positions=64, **size)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ds_config = json.load(open(args.deepspeed_config)) if args.deepspeed_config else DEFAULT_CONFIG
    engine, _, loader, _ = lightning_zero.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                                     training_data=Windows(256, 64, 256))
    for epoch in range(args.epochs):
        total, n = 0.0, 0
        for batch in loader:
            batch = batch.to(engine.device)
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            total, n = total + loss.item(), n + 1
        if engine.global_rank == 0:
            print(f"epoch {epoch} loss {total / n:.4f} (steps {engine.global_steps})", flush=True)
    state = engine.full_state_dict()
    if args.out and engine.global_rank == 0:
        plain = GPT2LMHeadModel(config)
        missing, unexpected = plain.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied to wte
        plain.save_pretrained(args.out)
        checksum = sum(float(p.double().sum()) for p in plain.parameters())
        print(f"saved {args.out} checksum {checksum:.6f}", flush=True)


if __name__ == "__main__":
    main()
