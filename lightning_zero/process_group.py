"""The process group's life, for both front ends (the Lightning strategy and the engine API).

[Note: one store per attempt]
Under torchrun the workers' process group uses the agent's TCPStore, which outlives a
restart, while torch (2.11-2.13) writes the group's keys (gloo's peer addresses, NCCL's unique
id) into it without a per-attempt prefix ("we create a new TCPStore for every retry"). After a
restart the new workers read the dead workers' addresses and fail with "connectFullMesh ...
Connection refused". Prefixing the store with the restart count gives every attempt its own
keys; it is what makes fault recovery by restart work at all.

[Note: destroy the group at exit]
gloo runs each collective on one of its worker threads, and that thread drops its reference
to the finished work (and so to the tensors the work moved) only after ``wait()`` has already
returned in Python. Our collectives move tensors created in Python, and freeing those takes
the GIL. A job ends milliseconds after its last collective (teardown gathers the full
parameters, then the script returns), so on a busy host a late gloo worker can ask for the
GIL after interpreter finalization has begun: CPython then ends that thread with
``pthread_exit``, whose forced unwind through a ``noexcept`` C++ destructor calls
``std::terminate`` ("terminate called without an active exception", SIGABRT) in a job that
had finished (core dump: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherWork`` ->
``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread``). Destroying every
group in an atexit handler, while the interpreter is still whole, joins gloo's workers
before finalization; every group object we hold is dropped there too (a group's threads live
as long as its object). After an exception we leave the groups alone: destroying them would
wait for collectives still in flight, which peers may never join.
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

if TYPE_CHECKING:
    from .collectives import Comm
    from .engine import ZeroEngine

__all__ = ["attempt_store", "start_lightning_group", "ExitHook", "exit_hook", "keep_engine", "take_kept_engine",
           "is_kept"]


def attempt_store(timeout: timedelta) -> Optional[Any]:
    """A store private to this torchrun attempt, or None outside torchrun's agent store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size=int(os.environ.get("WORLD_SIZE", "1")), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/lightning_zero/attempt_{attempt}", store)


def start_lightning_group(cluster_environment: Any, backend: str, timeout_s: float, device: Any) -> Comm:
    """Start (or join) the default group the way Lightning's strategies do, with this attempt's store;
    returns its Comm with a rendezvous group, both ended at exit if we started them."""
    from . import lightning_compat
    from .collectives import Comm

    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if device.type != "cpu":
        kwargs["device_id"] = device
    created = not (dist.is_available() and dist.is_initialized())
    store = attempt_store(kwargs["timeout"]) if created else None  # see [Note: one store per attempt]
    if store is not None:
        kwargs["store"] = store
    lightning_compat.init_process_group(cluster_environment, backend, **kwargs)
    if created:  # a group we started is also ours to end: see [Note: destroy the group at exit]
        exit_hook.arm(lightning_compat.destroy_process_group)
    exit_hook.clean = True
    comm = Comm.from_group(None, timeout_s=timeout_s).with_control()
    exit_hook.watch(comm)
    return comm


class ExitHook:
    """Ends, at interpreter exit, the process group we started (see [Note: destroy the group at exit])."""

    def __init__(self) -> None:
        self.armed = False
        self.clean = True  # False after an exception: leave the groups alone
        self.controls: list[Comm] = []  # rendezvous groups (collectives.Comm.with_control) to close and drop
        self._destroy: Callable[[], None] = _destroy_all

    def arm(self, destroy: Optional[Callable[[], None]] = None) -> None:
        """A group we started is ours to end: register the handler once (``destroy`` ends the default group)."""
        if destroy is not None:
            self._destroy = destroy
        if not self.armed:
            self.armed = True
            atexit.register(self._run)

    def watch(self, comm: Comm) -> None:
        self.controls = [c for c in self.controls if c.control is not None] + [comm]

    def _run(self) -> None:
        if self.clean:
            for engine in kept_engines():
                engine.end_gather_group()
            for comm in self.controls:
                comm.close_control()
            self._destroy()
        self.controls.clear()


def _destroy_all() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


exit_hook = ExitHook()

# module -> the stage-3 engine that still shards it after its fit (a later run unshards it first). Weak on both
# sides: a kept engine lives exactly as long as its module, which reaches it through the hooks and the routed
# ``zero_grad`` the engine installed; when the user drops the module, both go (a strong value would keep the
# module, its key, alive forever).
_kept_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def keep_engine(engine: ZeroEngine) -> None:
    _kept_engines[engine.module] = weakref.ref(engine)


def take_kept_engine(module: Any) -> Optional[ZeroEngine]:
    ref = _kept_engines.pop(module, None) if module is not None else None
    return ref() if ref is not None else None


def is_kept(module: Any) -> bool:
    """Whether a stage-3 engine of an earlier run still shards ``module``."""
    ref = _kept_engines.get(module) if module is not None else None
    return ref is not None and ref() is not None


def kept_engines() -> list[ZeroEngine]:
    return [e for e in (ref() for ref in list(_kept_engines.values())) if e is not None]
