"""Activation memory measured in a probe step on the real device.

A formula for activations misses what the kernels really keep (fused attention or not, the fp32
logits of the loss, recomputation's working set), and counting saved tensors on the meta device
takes other kernel paths than the GPU (meta attention saves the T x T matrix). So the planner's
activation figure comes from running forward and backward of the model at depth 2 and depth 3 on
the device it will train on, with the real micro-batch, dtype and checkpointing: what depth 3
keeps from forward to backward beyond depth 2 is one layer, and depth 2's allocator peak gives
the rest (embeddings, logits, the loss, one layer's backward or recomputation). Depth L is then
``peak(2) + (L - 2) * per_layer``. Gradients are dropped as soon as they are
produced, as the engine's reducer does, so they do not count as activations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ActivationProbe", "probe_activations", "next_token_step"]


@dataclass(frozen=True)
class ActivationProbe:
    base: int  # bytes every depth has (embeddings, final norm, logits, loss)
    per_layer: int  # bytes one more layer adds
    layers: int
    device: str

    @property
    def total(self) -> int:
        return max(0, self.base + self.layers * self.per_layer)

    def describe(self) -> str:
        gib = float(2**30)
        return (f"activations measured in a probe step on {self.device}: {self.per_layer / gib:.2f} GiB a layer "
                f"+ {self.base / gib:.2f} GiB, {self.total / gib:.1f} GiB at {self.layers} layers")


def probe_activations(build: Callable[[int], nn.Module], layers: int, step: Callable[[nn.Module], torch.Tensor],
                      device: torch.device, dtype: torch.dtype = torch.bfloat16,
                      checkpointing: tuple[str, ...] = ()) -> ActivationProbe:
    """Measure ``step``'s activation peak for ``build(2)`` and ``build(3)`` on ``device`` (CUDA).

    Args:
        build: a fresh model of the given depth (on any device; it is moved and cast here).
        layers: the depth to extrapolate to.
        step: runs one micro-batch's forward and returns the loss.
        dtype: the compute dtype (16-bit modules run under autocast like the engine's).
        checkpointing: module class names run under activation checkpointing, as the strategy option.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"the activation probe reads the CUDA allocator's peak and needs a GPU, not {device}: "
                         f"pass --activations GiB instead (or run it where the model will train)")
    (peak2, kept2), (_, kept3) = (_peak(build(depth), step, device, dtype, checkpointing) for depth in (2, 3))
    # a layer costs what it keeps for backward (read after forward). Depth 1 is not used: its only layer
    # keeps less than the others (measured on the H200: 117 MB against 151 MB a layer from depth 2 on).
    per_layer = max(0, kept3 - kept2)
    return ActivationProbe(base=peak2 - 2 * per_layer, per_layer=per_layer, layers=layers, device=str(device))


def next_token_step(tokens: torch.Tensor) -> Callable[[nn.Module], torch.Tensor]:
    """A probe step for a language model: next-token cross entropy (in fp32, as training computes it) of
    ``tokens`` (batch, seq + 1)."""

    def step(model: nn.Module) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    return step


def _peak(model: nn.Module, step: Callable[[nn.Module], torch.Tensor], device: torch.device, dtype: torch.dtype,
          checkpointing: tuple[str, ...]) -> tuple[int, int]:
    """(peak bytes of forward + backward, bytes kept from forward to backward), both above the model."""
    from .engine.activation import apply_activation_checkpointing

    model = model.to(device=device, dtype=dtype)
    model.train()
    apply_activation_checkpointing(model, checkpointing)
    hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in model.parameters() if p.requires_grad]
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = step(model)
        kept = torch.cuda.memory_allocated(device) - before
        loss.backward()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before, kept
    finally:
        for hook in hooks:
            hook.remove()
        del model
        torch.cuda.empty_cache()


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None
