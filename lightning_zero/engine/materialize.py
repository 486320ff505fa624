"""Materializing a model built on the meta device, one module at a time.

[Note: initialization and seeds]
A module created under ``trainer.init_module(empty_init=True)`` or in ``configure_model``
(stage 3) has meta parameters: no memory, no values. Each module gets real memory with
``to_empty`` and its values from its own ``reset_parameters()``, in ``named_modules`` order
(the order ``__init__`` usually creates them in), starting from the random-number state
captured when the meta context was entered. A model whose initialization lives in its
modules' ``reset_parameters`` therefore gets the same values as if it had been built for
real on the same device with the same seed. Values then come from rank 0 (broadcast), so
an unseeded run is still consistent across ranks. Right after a group's modules are
materialized the engine shards them, so no rank ever holds the whole model.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

__all__ = ["has_meta", "materialize_module", "model_initializers", "RngState", "check_no_meta_left",
           "move_all_but_flattened", "meta_parameters", "MetaBuild"]

class MetaBuild:
    """What :func:`meta_parameters` saw: ``rng``, the random state the meta parameters' initialization replays
    from (the state when the first parameter went to the meta device; None: every parameter is real)."""

    def __init__(self, real_bytes: int) -> None:
        self.real_left = real_bytes
        self.rng: Optional[RngState] = None
        self._real: dict[int, weakref.ref] = {}  # parameters left real (assigned again: a tie, kept)
        self._seen: Optional[RngState] = None  # the random state at the last registration since the first meta one
        self.drawn_before: Optional[str] = None  # the first parameter registered after a real draw (see note_draws)

    def note_draws(self, name: str) -> None:
        """[Note: draws during a meta build] The meta parameters are initialized later by replaying their
        ``reset_parameters`` from the random state at the first meta parameter, as if nothing else drew in
        between. A real draw after it (``nn.Parameter(torch.randn(...))`` on a module without
        ``reset_parameters``, a random buffer) takes the numbers a normal build gives the meta parameters, so it
        and every meta parameter after it get other values than that build with the same seed. Registrations
        compare the random state; the first one that finds it moved is named in a warning."""
        if self.rng is None:
            return
        now = RngState()
        if self._seen is not None and self.drawn_before is None and not now.same_as(self._seen):
            self.drawn_before = name
        self._seen = now

    def left_real(self, param: nn.Parameter) -> bool:
        ref = self._real.get(id(param))
        return ref is not None and ref() is param

    def keep_real(self, param: nn.Parameter) -> None:
        self._real[id(param)] = weakref.ref(param)


@contextmanager
def meta_parameters(device: torch.device, real_bytes: int = 0) -> Iterator[MetaBuild]:
    """Build a model with its parameters on the meta device and everything else for real on ``device``.

    The first ``real_bytes`` of parameters stay real: a model that small is built exactly as a normal build
    (any initialization in any ``__init__``), and sharded when the engine is built. Past them, each
    floating-point parameter of a module with ``reset_parameters()`` becomes a meta twin as it is registered
    (its memory is given back at once); the engine materializes it from ``reset_parameters`` replayed from the
    random state at that point (see [Note: initialization and seeds]), which a normal build would continue
    from. Buffers and the tensors ``__init__`` computes (a causal mask, rotary frequencies) keep their values:
    no ``reset_parameters`` would rebuild them; so do the parameters of a module without ``reset_parameters``
    (a hand-written LayerNorm's ``torch.ones``): those values are their only initialization.
    """
    build = MetaBuild(real_bytes)

    def to_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> Optional[nn.Parameter]:
        if param is None or param.is_meta or not param.is_floating_point() or build.left_real(param):
            return None
        build.note_draws(f"{type(module).__name__}.{name}")
        size = param.numel() * param.element_size()
        if size <= build.real_left and build.rng is None or not callable(getattr(module, "reset_parameters", None)):
            build.real_left -= size
            build.keep_real(param)
            return None
        if build.rng is None:
            build.rng = RngState()
            build.note_draws(f"{type(module).__name__}.{name}")
        return nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(to_meta)
    try:
        with torch.device(device):
            yield build
    finally:
        handle.remove()
    if build.drawn_before is not None:
        warnings.warn(
            f"lightning_zero: random numbers were drawn while the model was built on the meta device, before "
            f"'{build.drawn_before}' was registered (a parameter made with torch.randn in a module without "
            f"reset_parameters(), or a random buffer). The meta parameters are initialized by replaying their "
            f"reset_parameters() from the build's starting random state, so that parameter and the ones after it get "
            f"other values than a normal build with the same seed (DDP's): training is correct, from another "
            f"initialization. To match it, create such tensors in a module with reset_parameters(), or raise "
            f"real_init_bytes above the model's size to build it for real.", stacklevel=3)


class RngState:
    """CPU (and current CUDA device) generator state, captured once and replayed."""

    def __init__(self) -> None:
        self.cpu = torch.random.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def same_as(self, other: RngState) -> bool:
        cuda_same = (self.cuda is None) == (other.cuda is None) and (self.cuda is None or torch.equal(self.cuda, other.cuda))
        return torch.equal(self.cpu, other.cpu) and cuda_same

    def restore(self) -> None:
        torch.random.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)


def model_initializers(modules: list[tuple[str, nn.Module]]) -> Callable[[str], Optional[Callable]]:
    """name -> the initializer of the nearest enclosing model that initializes its submodules itself
    (Hugging Face's ``PreTrainedModel._init_weights(module)``, which a normal build applies to every module
    after construction); None where there is none. See :func:`materialize_module`."""
    owners = {name: m._init_weights for name, m in modules if callable(getattr(m, "_init_weights", None))}

    def initializer(name: str) -> Optional[Callable]:
        best = max((o for o in owners if o == "" or name == o or name.startswith(o + ".")), key=len, default=None)
        return owners[best] if best is not None else None

    return initializer


def move_all_but_flattened(module: nn.Module, device: torch.device) -> None:
    """Buffers and the parameters the engine does not flatten (not floating point) go to ``device`` now; the
    floating-point parameters stay where they are: the engine copies each unit's to the device as it builds that
    unit, and the old copy dies there. A module built in host memory therefore never sits whole on the GPU beside
    the masters, and its host memory is given back unit by unit.

    A subtree without floating-point parameters moves with its own ``.to()``: a torchmetrics ``Metric`` keeps its
    states as plain attributes that only its ``_apply`` knows."""
    if not any(p.is_floating_point() for p in module.parameters()):
        module.to(device)
        return
    for name, buffer in module._buffers.items():
        if buffer is not None:
            module._buffers[name] = buffer.to(device)
    for name, param in module._parameters.items():
        if param is not None and not param.is_floating_point():  # cannot require grad: no optimizer holds it
            module._parameters[name] = nn.Parameter(param.detach().to(device), requires_grad=False)
    for child in module.children():
        move_all_but_flattened(child, device)


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def _own_meta(module: nn.Module) -> bool:
    own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return any(t.is_meta for t in own)


@torch.no_grad()
def materialize_module(name: str, module: nn.Module, device: torch.device, remap: dict[int, nn.Parameter],
                       model_init: Optional[Callable[[nn.Module], None]] = None) -> None:
    """Give ``module``'s own meta tensors memory on ``device`` and values from ``reset_parameters``, then from
    ``model_init(module)`` when the enclosing model has one (a Hugging Face model: its own initialization
    overrides the modules' defaults in a normal build too, and covers modules without ``reset_parameters``).

    ``to_empty`` replaces meta Parameter objects by new ones; ``remap`` (id of the old -> new)
    collects them, and references to an already replaced parameter (a tied weight) are
    pointed at its new object first, so ties survive and keep their first owner's values.
    """
    for key, p in list(module._parameters.items()):
        if p is not None and id(p) in remap:
            module._parameters[key] = remap[id(p)]
    if not _own_meta(module):
        return
    before = dict(module._parameters)
    own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
    kept = {n: t.detach().clone() for n, t in own if not t.is_meta}  # to_empty replaces every own tensor
    empty = [n for n, t in own if t.is_meta]
    module.to_empty(device=device, recurse=False)
    for n in empty:  # a value nothing below writes stays NaN, and is caught
        if getattr(module, n).is_floating_point():
            getattr(module, n).data.fill_(float("nan"))
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
    if model_init is not None:
        model_init(module)
    for n, value in kept.items():
        getattr(module, n).data.copy_(value)
    missed = [n for n in empty if getattr(module, n).is_floating_point() and getattr(module, n).numel()
              and bool(getattr(module, n).isnan().all())]
    if missed or (not callable(reset) and model_init is None and empty):
        raise RuntimeError(
            f"Module '{name or type(module).__name__}' ({type(module).__name__}) was built on the meta device and "
            f"nothing gives {', '.join(repr(n) for n in (missed or empty))} values: "
            f"{'its reset_parameters() does not set them' if callable(reset) else 'it has no reset_parameters()'}"
            f"{' and the model initializer skips them' if model_init is not None else ''}, so they cannot be "
            f"initialized shard by shard. Initialize them in the module's reset_parameters(), or build the model "
            f"normally (ZeroStrategy builds on the meta device under trainer.init_module() and in configure_model).")
    for key, old in before.items():
        new = module._parameters[key]
        if old is not None and new is not old:
            remap[id(old)] = new



def check_no_meta_left(root: nn.Module) -> None:
    """Tensors kept outside parameters and buffers (torchmetrics states, cached masks) have no
    ``reset_parameters`` to rebuild them: if they were made on the meta device, say so."""
    for name, module in root.named_modules():
        for attr, value in vars(module).items():
            values = value.values() if attr == "_defaults" and isinstance(value, dict) else [value]
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in values):
                raise RuntimeError(
                    f"'{name or 'model'}' ({type(module).__name__}) holds the tensor '{attr}' on the meta device: it "
                    f"is neither a parameter nor a buffer, so it cannot be rebuilt after meta-device construction "
                    f"(stage 3 builds under trainer.init_module() and in configure_model on the meta device). Create "
                    f"such objects (torchmetrics metrics, precomputed tensors) in __init__ outside "
                    f"trainer.init_module(), or register them as buffers of a module with reset_parameters().")
