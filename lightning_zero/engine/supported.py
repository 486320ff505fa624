"""What the flat fp32 units cannot hold, refused at setup with the parameter's name and the way out.

Every floating-point parameter becomes part of a flat unit with an fp32 master, computed in the Trainer's
precision: a float64 parameter would silently train in fp32 (DDP trains it in float64), a complex one is not
floating point and stays outside the units (its optimizer would meet an unmanaged tensor), and a sparse
gradient (``nn.Embedding(sparse=True)``) cannot be copied into a flat buffer.
"""

from __future__ import annotations

from torch import nn

from ..config import ZeroConfigError

__all__ = ["check_supported", "SPARSE_GRADIENT"]

SPARSE_GRADIENT = ("lightning_zero reduces gradients into flat dense buffers; {what} makes sparse gradients. Use "
                   "sparse=False (nn.Embedding / nn.EmbeddingBag, F.embedding): its dense gradient trains the same.")


def check_supported(module: nn.Module) -> None:
    for name, owner in module.named_modules():
        if isinstance(owner, (nn.Embedding, nn.EmbeddingBag)) and owner.sparse and owner.weight.requires_grad:
            raise ZeroConfigError(SPARSE_GRADIENT.format(what=f"'{name}' ({type(owner).__name__}, sparse=True)"))
    odd = [(n, p) for n, p in module.named_parameters() if p.is_complex() or p.dtype.is_floating_point
           and p.itemsize > 4]
    if odd:
        named = ", ".join(f"'{n}' ({str(p.dtype).replace('torch.', '')})" for n, p in odd[:3])
        raise ZeroConfigError(
            f"Parameters {named}{' and more' if len(odd) > 3 else ''} are not float32/bf16/fp16: lightning_zero keeps "
            f"fp32 masters and computes in the Trainer's precision, so they would train in fp32 (float64) or stay "
            f"outside ZeRO (complex). Convert the model with .float() (a complex weight: store it as a real tensor "
            f"with torch.view_as_real), or register a tensor that is not trained as a buffer.")
