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
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch
from torch import nn
from torch.profiler import record_function

from .optim import fuse_on_host

__all__ = ["DelayedStep"]


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

    def launch(self, optimizer: torch.optim.Optimizer, pieces_by_group: list[list[nn.Parameter]],
               units: list[Any], fused: bool, after: Any = None) -> None:
        """Hand the update of ``pieces_by_group`` (this rank's offloaded pieces with a gradient, per group of
        ``optimizer``) to the worker; ``units`` are published when it is done. ``fused``: use torch's fused CPU
        kernel where :func:`fuse_on_host` allows (a GPU computes; as the regular host step). ``after``: a CUDA event the
        worker waits for first (the copies that publish the previous update read the pinned master
        asynchronously: it must not change under them)."""
        assert self.future is None, "settle() the running update first"
        shadow = object.__new__(type(optimizer))
        shadow.__dict__.update(optimizer.__dict__)  # defaults, hooks, flags; groups and state replaced below
        shadow.state = defaultdict(dict)
        groups = []
        for group, pieces in zip(optimizer.param_groups, pieces_by_group):
            params = []
            for piece in pieces:
                twin = nn.Parameter(piece.detach(), requires_grad=True)  # the piece's storage
                twin.grad = piece.grad
                shadow.state[twin] = optimizer.state[piece]  # the same dict: the update lands in the real state
                params.append(twin)
            snapshot = {k: v for k, v in group.items() if k != "params"}
            if fused and fuse_on_host(optimizer, group):
                snapshot["fused"] = True
            groups.append({**snapshot, "params": params})
        shadow.param_groups = groups
        self.units = units
        self.launched += 1
        self.future = self.pool.submit(self._run, shadow, after)

    def _run(self, shadow: torch.optim.Optimizer, after: Any) -> None:
        if after is not None:
            after.synchronize()
        start = time.perf_counter()
        try:
            with torch.no_grad(), record_function("zero/delayed_host_step"):
                type(shadow).step(shadow)
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
