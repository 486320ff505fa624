"""The delayed host step (``delayed_step=True``): step t's host update runs while step t+1 computes.

ZeRO-Offload's delayed parameter update. At the step of window t the device part steps at once and
the offloaded units' update is handed to a worker thread; forward and backward of window t+1 run on
the values the device already has (those of step t-1), and at the step of window t+1 the worker's
result is waited for and published before the next update is handed over. Each offloaded
update therefore uses gradients one step stale, from the second step on: an approximation the
user opts into, for a host step that costs no time while it fits under forward and backward.

What keeps the two threads apart:
- the worker steps *shadow* parameters: tensors sharing storage with the fp32 pieces, with the
  window's gradient views as ``.grad``, in a shadow of the optimizer whose groups are a snapshot
  of the real ones (a scheduler may change the learning rate for the next step meanwhile) and
  whose state is the real state's per-piece dicts. The main thread's gradients, groups and
  parameters are never touched by it;
- the next window's offloaded gradients land in a second host arena (the offloader swaps them);
- nothing reads the fp32 master while the worker runs: forward reads the device copies (which is
  why parameters offloaded to the host, read by stage-3 gathers, are refused), and checkpoints,
  evaluation and the end of fit wait for the worker first (``settle``).
- a step whose pieces have no optimizer state yet (the first, or after new groups) runs at once:
  the state torch creates lazily must be created in the real optimizer.

[Note: early publish]
Waiting until the step of window t+1 to copy the update up would put the whole upload (4 bytes a
parameter over PCIe) between that step and the next forward. Instead the worker steps chunk by chunk,
and a unit's new values go up (its own chunk, on the upload stream) as soon as both are true: the
worker has stepped it, and its backward of window t+1 is done (its final reduced gradient has come,
so nothing in this window reads its parameters any more). What is left at the step is the last
chunk's upload and, with several ranks, the all-gather of the other ranks' chunks. A gradient that
reaches a unit after that (reentrant checkpointing computes some twice) would have been computed
from the new values: it is refused with a clear error.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Lock
from typing import Any, Optional

import torch
from torch import nn
from torch.profiler import record_function

from .optim import fuse_on_host

__all__ = ["DelayedStep", "EarlyPublish"]


class DelayedStep:
    """One update at a time, on a worker thread."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lz-delayed-step")
        self.future: Optional[Future] = None
        self.units: list[Any] = []  # stepped by the running update: to publish once it is done
        self.seconds = seconds
        self.seconds.setdefault("delayed_host_step", 0.0)
        self.launched = 0  # updates handed to the worker (diagnostics, tests)

    @staticmethod
    def ready(optimizer: torch.optim.Optimizer, pieces: list[nn.Parameter]) -> bool:
        """Whether every piece already has its optimizer state (else this step runs at once)."""
        return all(optimizer.state.get(p) for p in pieces)

    def launch(self, optimizer: torch.optim.Optimizer, chunks: list[tuple[list[Any], list[list[nn.Parameter]]]],
               fused: bool, after: Any = None, on_stepped: Optional[Callable[[list[Any]], None]] = None) -> None:
        """Hand the update to the worker: ``chunks`` are (units, this rank's offloaded pieces with a gradient per
        group of ``optimizer``), stepped in that order, ``on_stepped(units)`` called after each; all the units
        are published when it is done. ``fused``: use torch's fused CPU kernel where :func:`fuse_on_host` allows
        (a GPU computes; as the regular host step). ``after``: a CUDA event the worker waits for first (the
        copies that publish the previous update read the pinned master asynchronously: it must not change
        under them)."""
        assert self.future is None, "settle() the running update first"
        shadow = object.__new__(type(optimizer))
        shadow.__dict__.update(optimizer.__dict__)  # defaults, hooks, flags; groups and state replaced below
        shadow.state = defaultdict(dict)
        snapshots = []
        for group in optimizer.param_groups:
            snapshot = {k: v for k, v in group.items() if k != "params"}
            if fused and fuse_on_host(optimizer, group):
                snapshot["fused"] = True
            snapshots.append(snapshot)
        plan = []
        for units, pieces_by_group in chunks:
            groups = []
            for snapshot, pieces in zip(snapshots, pieces_by_group):
                params = []
                for piece in pieces:
                    twin = nn.Parameter(piece.detach(), requires_grad=True)  # the piece's storage
                    twin.grad = piece.grad
                    shadow.state[twin] = optimizer.state[piece]  # the same dict: the update lands in the real state
                    params.append(twin)
                groups.append({**snapshot, "params": params})
            plan.append((units, groups))
        self.units = [u for units, _ in chunks for u in units]
        self.launched += 1
        self.future = self.pool.submit(self._run, shadow, plan, after, on_stepped)

    def _run(self, shadow: torch.optim.Optimizer, plan: list[tuple[list[Any], list[dict]]], after: Any,
             on_stepped: Optional[Callable[[list[Any]], None]]) -> None:
        if after is not None:
            after.synchronize()
        start = time.perf_counter()
        try:
            with torch.no_grad():
                for units, groups in plan:
                    if any(g["params"] for g in groups):
                        shadow.param_groups = groups
                        with record_function("zero/delayed_host_step"):
                            type(shadow).step(shadow)
                    if on_stepped is not None:
                        on_stepped(units)
        finally:
            self.seconds["delayed_host_step"] += time.perf_counter() - start

    def settle(self) -> list[Any]:
        """Wait for the running update (if any); the units it stepped, now to publish."""
        if self.future is None:
            return []
        start = time.perf_counter()
        future, self.future = self.future, None
        try:
            future.result()
        finally:
            self.seconds["wait_for_host"] = self.seconds.get("wait_for_host", 0.0) + time.perf_counter() - start
        units, self.units = self.units, []
        return units

    @property
    def running(self) -> bool:
        return self.future is not None

    def close(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None
        self.pool.shutdown(wait=True)


class EarlyPublish:
    """Publishes each unit of the running update once it is stepped and its next backward is done (see [Note:
    early publish]). Called from the worker (``stepped``) and from backward's hooks (``backward_done``).

    Args:
        stream: the upload stream (None without a GPU: the copy is made at once).
        device: the compute device.
    """

    def __init__(self, stream: Any, device: torch.device) -> None:
        self.stream, self.device = stream, device
        self.lock = Lock()
        self.pending: set[int] = set()  # units of the running update not published yet
        self.stepped: set[int] = set()
        self.done: dict[int, Any] = {}  # units whose backward is done -> an event after it (None on the CPU)
        self.published: set[int] = set()
        self.count = 0  # units published early so far (diagnostics, tests)
        self.never: set[int] = set()  # units that got a late gradient: published at the step

    def start(self, units: list[Any]) -> None:
        with self.lock:
            self.pending = {u.index for u in units} - self.never
            self.stepped, self.done, self.published = set(), {}, set()

    def on_stepped(self, units: list[Any]) -> None:
        with self.lock:
            for unit in units:
                self.stepped.add(unit.index)
                if unit.index in self.done and unit.index in self.pending:
                    self._publish(unit)

    def backward_done(self, unit: Any) -> None:
        """``unit``'s final gradient of this window was reduced: its backward no longer reads its parameters."""
        with self.lock:
            if unit.index not in self.pending or unit.index in self.done:
                return
            event = None
            if self.stream is not None:  # after every kernel queued so far, the unit's backward among them
                event = torch.cuda.current_stream(self.device).record_event()
            self.done[unit.index] = event
            if unit.index in self.stepped:
                self._publish(unit)

    def _publish(self, unit: Any) -> None:
        self.pending.discard(unit.index)
        self.published.add(unit.index)
        self.count += 1
        with record_function("zero/publish"):
            if self.stream is None:
                unit.publish_own()
                return
            event = self.done[unit.index]
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(event)
                unit.publish_own()

    def late(self, unit: Any) -> bool:
        """A gradient reached ``unit`` after its backward seemed done: False when its update already went up (the
        gradient was computed from the new values). Such a unit is published at the step from now on: a late
        gradient comes from how the model runs (a weight used inside and outside a reentrant checkpoint), so it
        comes every window, the first (stepped at once) included."""
        with self.lock:
            self.never.add(unit.index)
            self.pending.discard(unit.index)
            return unit.index not in self.published

    def finish(self) -> frozenset[int]:
        """Once the worker is done: the units published early (their uploads now come before anything queued
        next on the compute stream); nothing more is published until the next ``start``."""
        with self.lock:
            published = frozenset(self.published)
            self.pending, self.stepped, self.done, self.published = set(), set(), {}, set()
        if self.stream is not None and published:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return published
