"""Adopting the user's optimizer: keep the object and its parameters, step this rank's pieces.

[Note: why the module's parameters stay in the optimizer]
LR schedulers, Lightning's LightningOptimizer, ``toggle_optimizer`` and callbacks such as
``BackboneFinetuning`` hold the optimizer and read or change its ``param_groups`` in terms of
the module's parameters (identity maps, ``add_param_group`` with newly unfrozen layers).
So the groups keep the module's parameters. Only for the duration of a step each group's
list is swapped for the fp32 *pieces* of those parameters this rank owns (see
:mod:`lightning_zero.engine.flat_unit`); the optimizer's ``state`` is therefore keyed by
pieces. A piece whose parameter got no gradient on any rank keeps ``grad = None`` and
torch's optimizers leave it, and its state, alone. This is exact only for optimizers whose
update is elementwise: each element's new value depends on its own history alone.

The adopted optimizer's ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict``
are routed through the engine, so calling them directly cannot silently do nothing.

[Note: state by parameter]
User code reaches a parameter's state by the parameter: ``if p in opt.state: opt.state[p].clear()`` restarts
Adam for re-initialised layers. Keyed by pieces, that would find nothing and silently change nothing. So while
an engine steps the optimizer its ``state`` is a :class:`PieceKeyedState`: a module parameter as key means this
rank's piece of it. Clearing, deleting or replacing a parameter's state is then what DDP does (a piece's state,
its ``step`` included, is that parameter's state for the piece's elements); a rank that holds none of the
parameter finds no state for it and has nothing to change. Values read this way are the piece's, flat, as
``safe_get_local_optimizer_state`` gives them (``safe_get_full_optimizer_state`` gathers the whole tensor).
"""

from __future__ import annotations

import inspect
import types
import weakref
from collections import defaultdict
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["ELEMENTWISE_OPTIMIZERS", "UnsupportedOptimizerError", "check_optimizer", "check_params", "Routes",
           "PieceKeyedState",
           "pieces_in_groups",
           "lazy_state_bytes", "unwrap", "fuse_on_host"]

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in
    ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
    if hasattr(torch.optim, name)
)
_ROUTED = ("step", "zero_grad", "state_dict", "load_state_dict")


class UnsupportedOptimizerError(TypeError):
    """The optimizer's math is not known to be exact on flat shards."""


def unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """The user's optimizer behind Lightning's LightningOptimizer."""
    return getattr(optimizer, "_optimizer", optimizer)


def check_optimizer(optimizer: torch.optim.Optimizer, allow_untested: bool) -> None:
    """Refuse optimizers whose update is not known to be elementwise.

    A subclass of a known optimizer passes only if it does not override ``step``.
    """
    # torch wraps ``step`` of each optimizer class for profiling: compare the unwrapped functions.
    step = inspect.unwrap(type(optimizer).step)
    if any(isinstance(optimizer, cls) and step is inspect.unwrap(cls.step) for cls in ELEMENTWISE_OPTIMIZERS):
        return
    if isinstance(optimizer, getattr(torch.optim, "SparseAdam", ())):
        raise UnsupportedOptimizerError(
            "SparseAdam steps sparse gradients, which lightning_zero's flat shards cannot hold: use Adam or AdamW "
            "(with sparse=False embeddings), or train this model under DDP.")
    closure = inspect.signature(step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__}.step needs the closure to evaluate the loss again (as LBFGS does), which "
            f"lightning_zero's step cannot give: it runs the closure once, then steps each rank's flat shards. Use an "
            f"elementwise optimizer, or train this one under DDP.")
    if allow_untested:
        return
    names = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
    raise UnsupportedOptimizerError(
        f"lightning_zero steps the optimizer on flat parameter shards, which is exact only for "
        f"elementwise optimizers ({names}). {type(optimizer).__name__} is not one of them, so its "
        f"result could differ from unsharded training. Use one of those, or set "
        f"ZeroConfig(allow_untested_optimizer=True) if you know its update is elementwise."
    )


def check_params(k: int, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
    """Optimizer ``k`` holds only the model's parameters (``names``: id -> name), each in one group."""
    seen: dict[int, str] = {}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"Optimizer {k} ({type(optimizer).__name__}) param group {g} holds a tensor of shape "
                    f"{tuple(p.shape)} that is not a parameter of the model. lightning_zero can only shard the "
                    f"model's own parameters: pass self.parameters() (or a subset) to it.")
            if id(p) in seen:
                raise ValueError(
                    f"Parameter '{names[id(p)]}' appears in two optimizer param groups ({seen[id(p)]} and "
                    f"optimizer {k} group {g}); each parameter can belong to one only.")
            seen[id(p)] = f"optimizer {k} group {g}"


_NOT_MANAGED = (False, None)


class PieceKeyedState(defaultdict):
    """An engine-stepped optimizer's ``state`` (see [Note: state by parameter]). ``resolve(key)`` says whether
    ``key`` is a parameter the engine manages and which piece of it this rank holds (None: none)."""

    def __init__(self, default_factory: Any = dict, *args: Any,
                 resolve: Callable[[Any], tuple[bool, Any]] = lambda key: _NOT_MANAGED) -> None:
        super().__init__(default_factory, *args)
        # a bound method (the engine's) is held weakly: the optimizer may outlive its engine
        self._resolve = weakref.WeakMethod(resolve) if inspect.ismethod(resolve) else lambda: resolve

    def resolve(self, key: Any) -> tuple[bool, Any]:
        method = self._resolve()
        return method(key) if method is not None else _NOT_MANAGED

    def __reduce__(self) -> Any:  # copies and pickles are plain state
        return (defaultdict, (self.default_factory,), None, None, iter(self.items()))

    def _key(self, key: Any) -> tuple[bool, Any]:
        if not isinstance(key, torch.Tensor):
            return False, key
        managed, piece = self.resolve(key)
        return (True, piece) if managed else (False, key)

    def __getitem__(self, key: Any) -> Any:
        managed, key = self._key(key)
        if managed and key is None:  # none of it here: nothing to change on this rank, empty values to read
            return defaultdict(lambda: torch.empty(0))
        return super().__getitem__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        managed, key = self._key(key)
        if not (managed and key is None):
            super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        managed, key = self._key(key)
        if not (managed and key is None):
            super().__delitem__(key)

    def __contains__(self, key: Any) -> bool:
        managed, key = self._key(key)
        return key is not None and super().__contains__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        managed, key = self._key(key)
        return default if key is None else super().get(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        managed, key = self._key(key)
        if key is None:
            if default:
                return default[0]
            raise KeyError("this rank holds none of the parameter")
        return super().pop(key, *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        managed, key = self._key(key)
        return default if key is None else super().setdefault(key, default)


def key_state_by_pieces(optimizer: torch.optim.Optimizer, resolve: Callable[[Any], tuple[bool, Any]]) -> None:
    optimizer.state = PieceKeyedState(dict, optimizer.state, resolve=resolve)


def plain_state(optimizer: torch.optim.Optimizer) -> None:
    if isinstance(optimizer.state, PieceKeyedState):
        optimizer.state = defaultdict(dict, optimizer.state)


class Routes:
    """The engine's side of adopted optimizers: each one's own step, and every object whose
    ``zero_grad`` / ``state_dict`` must reach the engine (the optimizer, Lightning's
    ``LightningOptimizer`` wrappers of it, the module).

    [Note: routing]
    The user's optimizer object stays in the user's hands, so its ``step``, ``zero_grad``,
    ``state_dict`` and ``load_state_dict`` are replaced on the instance and given back at
    ``release``; what the engine needs to remember (the optimizer's own step) stays here, not
    on the optimizer. A ``LightningOptimizer`` finds ``zero_grad`` on its class (torch's, which
    would only clear the module parameters' ``.grad``, never the engine's gradients), and
    Lightning builds new wrappers whenever ``strategy.optimizers`` is set: each is routed as
    it appears (:meth:`route_wrapper`). ``module.zero_grad()`` clears every gradient, as under DDP.
    """

    def __init__(self) -> None:
        self.inner: dict[int, Callable] = {}  # id(optimizer) -> its own step
        self._targets: list[Any] = []  # objects whose methods were replaced

    def adopt(self, optimizer: torch.optim.Optimizer, step: Callable, zero_grad: Callable,
              pieces: Optional[Container[int]] = None,
              resolve: Optional[Callable[[Any], tuple[bool, Any]]] = None) -> None:
        """Route ``optimizer``'s methods through the engine.

        Args:
            optimizer: the user's optimizer, still holding the module's parameters.
            step: ``step(optimizer, closure, **kwargs)``: the engine's step.
            zero_grad: ``zero_grad(optimizer, set_to_none)``: clears the optimizer's gradients.
            pieces: ids of the engine's pieces: state kept by them is this engine's own (an optimizer set back
                during fit after another replaced it), not state of the unsharded parameters.
            resolve: a module parameter -> (managed, this rank's piece): ``state`` answers by parameter too (see
                [Note: state by parameter]).
        """
        if pieces is not None and optimizer.state and all(id(p) in pieces for p in optimizer.state):
            pass  # stepped by this engine before: its state stays
        elif any(len(s) for s in optimizer.state.values()) and not _never_stepped(optimizer):
            raise RuntimeError(
                "The optimizer already holds state before lightning_zero sharded it. Create it in "
                "configure_optimizers without stepping it, or restore its state from a checkpoint after setup.")
        else:
            optimizer.state.clear()  # what a constructor made (Adagrad's sums): each piece's state starts fresh alike
        if resolve is not None:
            key_state_by_pieces(optimizer, resolve)
        original_zero_grad = optimizer.zero_grad
        inner_step = optimizer.step
        self.inner[id(optimizer)] = inner_step

        def zero_step(self: Any, closure: Optional[Callable] = None, **kwargs: Any) -> Any:
            return step(optimizer, closure, **kwargs)

        def zero_zero_grad(self: Any, set_to_none: bool = True) -> None:
            original_zero_grad(set_to_none=set_to_none)
            zero_grad(optimizer, set_to_none)

        if getattr(inner_step, "_wrapped_by_lr_sched", False):  # the scheduler's own wrapper still runs inside
            zero_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = types.MethodType(zero_step, optimizer)  # a LightningOptimizer steps through the strategy
        optimizer.zero_grad = types.MethodType(zero_zero_grad, optimizer)
        optimizer.state_dict = types.MethodType(_no_state_dict, optimizer)
        optimizer.load_state_dict = types.MethodType(_no_state_dict, optimizer)
        self._targets.append(optimizer)

    def release_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Give one optimizer (and its wrappers) its own methods back: the run no longer steps it (replaced during
        fit); its state stays with it, freed with it as under DDP."""
        for target in self._targets:
            if unwrap(target) is optimizer:
                self._unroute(target)
        self._targets = [t for t in self._targets if unwrap(t) is not optimizer]
        self.inner.pop(id(optimizer), None)

    def route_wrapper(self, wrapper: Any) -> None:
        """A wrapper of an adopted optimizer (``LightningOptimizer``) clears and saves through it."""
        optimizer = unwrap(wrapper)
        if wrapper is optimizer or id(optimizer) not in self.inner or wrapper.__dict__.get("zero_grad") is not None:
            return
        for name in _ROUTED[1:]:
            wrapper.__dict__[name] = getattr(optimizer, name)
        self._targets.append(wrapper)

    def route_module(self, module: nn.Module, zero_all: Callable[[], None]) -> None:
        """``module.zero_grad()`` also clears the engine's gradients of every parameter."""
        original = module.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            original(set_to_none=set_to_none)
            zero_all()

        module.__dict__["zero_grad"] = zero_grad
        self._targets.append(module)

    def inner_step(self, optimizer: torch.optim.Optimizer) -> Callable:
        return self.inner[id(unwrap(optimizer))]

    def release(self) -> None:
        """Undo every routing (teardown): the objects' own methods again."""
        for target in self._targets:
            self._unroute(target)
        self._targets.clear()
        self.inner.clear()

    def _unroute(self, target: Any) -> None:
        """One routed object's own methods again (an optimizer keeps an LR scheduler's step counter)."""
        inner = self.inner.get(id(target))
        if isinstance(target, torch.optim.Optimizer):
            plain_state(target)
        for name in _ROUTED:
            target.__dict__.pop(name, None)
        if inner is not None and getattr(inner, "_wrapped_by_lr_sched", False):
            target.step = inner


def _never_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """State the constructor made (torch's Adagrad fills ``sum`` and ``step`` = 0 in ``__init__``) rather than a
    step: the same state is made again, per piece, at the first step."""
    def zero(value: Any) -> bool:
        return value is not None and float(value) == 0.0
    return all(zero(state.get("step")) for state in optimizer.state.values() if len(state))


def _no_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        "This optimizer is sharded by lightning_zero: its state lives in pieces spread over the ranks. "
        "Save and restore it with trainer.save_checkpoint / trainer.fit(ckpt_path=...); for the full, consolidated "
        "state as the unsharded optimizer's state_dict() would give it, call "
        "trainer.strategy.full_optimizer_state_dict(optimizer) on every rank (rank 0 gets it).")


def lazy_state_bytes(optimizer: torch.optim.Optimizer, group: dict) -> int:
    """Bytes per fp32 element of state that ``optimizer`` creates at its first step for a parameter of ``group``
    (Adagrad creates its state at construction: 0)."""
    name = type(optimizer).__name__
    if name == "Adagrad":
        return 0
    if name == "SGD":
        return 4 if group.get("momentum", 0) else 0
    if name == "RMSprop":
        return 4 * (1 + bool(group.get("momentum", 0)) + bool(group.get("centered", False)))
    return 4 * (2 + bool(group.get("amsgrad", False)))  # Adam and its kin: two moments (three with amsgrad)


_FUSABLE: tuple[type, ...] = tuple(getattr(torch.optim, n) for n in ("Adam", "AdamW", "SGD", "Adagrad")
                                    if hasattr(torch.optim, n))


def fuse_on_host(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Whether a host step of ``group`` may switch to torch's fused CPU kernel: an optimizer that has one, and the
    user chose no implementation (foreach / fused / capturable / differentiable)."""
    return (isinstance(optimizer, _FUSABLE) and "fused" in group and not group["fused"] and not group.get("foreach")
            and not group.get("capturable") and not group.get("differentiable"))


@contextmanager
def pieces_in_groups(optimizer: torch.optim.Optimizer,
                     piece_of: Callable[[nn.Parameter], Optional[nn.Parameter]]) -> Iterator[None]:
    """For a step: each group lists this rank's pieces of its parameters instead of the parameters."""
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["params"] = [q for q in (piece_of(p) for p in group["params"]) if q is not None]
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params
