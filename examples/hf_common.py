"""What the two Hugging Face GPT-2 examples share: the model size, the data and save_pretrained.

Imported as ``hf_common`` by ``examples/hf_gpt2_engine.py`` and ``examples/hf_gpt2_lightning.py``
(run as scripts, so this directory is on ``sys.path``).
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, LENGTH = 256, 64  # random-token data: a small vocabulary keeps the embedding cheap


def gpt2_config(tiny: bool) -> GPT2Config:
    """GPT-2 small (124M layout, 256-token vocabulary) or a 2-layer x 64 smoke-test model."""
    size = dict(n_layer=2, n_embd=64, n_head=2) if tiny else dict(n_layer=12, n_embd=768, n_head=12)
    return GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, **size)


class Windows(torch.utils.data.Dataset):
    """Random token windows with a learnable pattern (each token repeats the one two places back)."""

    def __init__(self, vocab: int = VOCAB, length: int = LENGTH, count: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (count, length), generator=g)
        self.data[:, 2:] = self.data[:, :-2].clone()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def save_pretrained(state: dict[str, torch.Tensor], config: GPT2Config, out: str) -> float:
    """Write ``state`` (a full fp32 state dict, GPT2LMHeadModel's keys) with HF's ``save_pretrained``.

    Returns a checksum of the saved parameters, so a reader can check that ``from_pretrained``
    (without lightning_zero) gives the same model.
    """
    plain = GPT2LMHeadModel(config)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    # lm_head.weight is tied to transformer.wte.weight: one tensor, saved under the embedding's key
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise RuntimeError(f"state does not match GPT2LMHeadModel: missing {missing}, unexpected {unexpected}")
    plain.save_pretrained(out)
    return checksum(plain)


def checksum(model: torch.nn.Module) -> float:
    return sum(float(p.detach().double().sum()) for p in model.parameters())
