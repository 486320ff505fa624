"""A Hugging Face GPT-2 trained with lightning_zero's DeepSpeed-style engine API.

    torchrun --nproc_per_node 2 examples/hf_gpt2_engine.py                      # GPT-2 small layout
    torchrun --nproc_per_node 2 examples/hf_gpt2_engine.py --tiny --out /tmp/gpt2-trained   # CPU smoke run
    torchrun --nproc_per_node 8 examples/hf_gpt2_engine.py --deepspeed_config my_ds_config.json

The model is built from a ``GPT2Config`` (no download); the data are random token windows. Needs
``pip install transformers`` (the ``hf`` extra). At the end rank 0 writes ``save_pretrained`` from the
consolidated fp32 weights: ``GPT2LMHeadModel.from_pretrained(out)`` loads it without lightning_zero.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from hf_common import Windows, gpt2_config, save_pretrained
from transformers import GPT2LMHeadModel

import lightning_zero

DEFAULT_CONFIG = Path(__file__).with_name("ds_config_gpt2.json")  # stage 3, AdamW, WarmupLR, clipping


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspeed_config", help=f"ds_config.json (default: {DEFAULT_CONFIG.name})")
    ap.add_argument("--tiny", action="store_true", help="2 layers x 64: a CPU smoke run")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--checkpointing", action="store_true", help="HF gradient checkpointing (reentrant)")
    ap.add_argument("--out", help="save_pretrained directory (rank 0)")
    args = ap.parse_args()
    config = gpt2_config(args.tiny)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ds_config = json.loads(Path(args.deepspeed_config or DEFAULT_CONFIG).read_text())
    engine, _, loader, _ = lightning_zero.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                                     training_data=Windows())
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
        print(f"saved {args.out} checksum {save_pretrained(state, config, args.out):.6f}", flush=True)


if __name__ == "__main__":
    main()
