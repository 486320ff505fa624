"""Every data-moving collective of lightning_zero, behind one explicit process group.

[Note: why one module]
Engine logic never calls torch.distributed itself: it hands tensors and a ``Comm`` here.
That keeps the torch-version shim, gloo portability, the traffic counters and the
world-size-1 shortcut in one place, and lets tests count exactly what a step moved.

torch 2.13 names the flat collectives ``reduce_scatter_single``/``all_gather_single``;
2.11 has only ``reduce_scatter_tensor``/``all_gather_into_tensor``. Gloo has no AVG, so
averages are SUM followed by a division done by the caller.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["Comm", "Handle", "MissingRanksError"]


class MissingRanksError(RuntimeError):
    """A collective a user called was not reached by every rank (called under ``if rank == 0:``?)."""

_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Handle:
    """An in-flight collective; ``wait()`` is idempotent and a no-op for finished work."""

    __slots__ = ("_work", "keep")

    def __init__(self, work: Any = None, keep: tuple = ()) -> None:
        self._work = work
        self.keep = keep  # tensors that must outlive the collective

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        self.keep = ()


@dataclass
class Comm:
    """Collectives over ``group`` (None = the default group) for one rank.

    Args:
        rank: this process's rank in ``group``.
        world_size: number of ranks in ``group``.
        group: the process group; ignored when ``world_size`` is 1.
    """

    rank: int = 0
    world_size: int = 1
    group: Optional[Any] = None
    bytes_moved: Counter = field(default_factory=Counter)  # op name -> bytes of full-size tensor
    # LIGHTNING_ZERO_FORCE_COLLECTIVES=1 runs real collectives even on one rank (to profile overlap).
    force: bool = field(default_factory=lambda: os.environ.get("LIGHTNING_ZERO_FORCE_COLLECTIVES") == "1")
    control: Optional[Any] = None  # gloo group of the entry checks of user-called collectives (rendezvous)
    host: Optional[Any] = None  # gloo group of the same ranks for host tensors (see host_group)
    meshes: dict = field(default_factory=dict)  # device type -> DeviceMesh over this group (see mesh)
    # each collective's wait limit (ZeroConfig.collective_timeout_s) on the groups made here; torch's new_group
    # would give them its backend default (30 minutes) instead of the default group's
    timeout_s: Optional[float] = None

    @property
    def _local(self) -> bool:
        return self.world_size == 1 and not (self.force and dist.is_initialized())

    @classmethod
    def from_group(cls, group: Optional[Any] = None, timeout_s: Optional[float] = None) -> Comm:
        if not (dist.is_available() and dist.is_initialized()):
            return cls(timeout_s=timeout_s)
        return cls(dist.get_rank(group), dist.get_world_size(group), group, timeout_s=timeout_s)

    def _new_group(self, backend: str) -> Any:
        """A group of these ranks (a collective call: every rank makes it) with this Comm's wait limit."""
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(dist.get_world_size()))
        timeout = timedelta(seconds=self.timeout_s) if self.timeout_s is not None else None
        return dist.new_group(ranks, backend=backend, timeout=timeout)

    def sibling(self) -> Comm:
        """The same ranks on a second process group (a collective call: every rank must make it).

        Stage 3 gathers parameters on it, so that a prefetch all-gather issued in backward does
        not queue behind reduce-scatters still in flight on the first group (one NCCL
        communicator, or one gloo work queue, runs its collectives in issue order).
        """
        if self._local or not dist.is_initialized():
            return self
        return Comm(self.rank, self.world_size, self._new_group(dist.get_backend(self.group)), self.bytes_moved,
                    self.force, timeout_s=self.timeout_s)

    @property
    def backend(self) -> str:
        if self.world_size == 1:
            return "none"
        return str(dist.get_backend(self.group))

    def _count(self, op: str, tensor: torch.Tensor) -> None:
        self.bytes_moved[op] += tensor.numel() * tensor.element_size()

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Handle:
        """Sum ``full`` (world_size * len(output) elements) across ranks; keep this rank's chunk."""
        self._count("reduce_scatter", full)
        if self._local:
            output.copy_(full)
            return Handle()
        work = _REDUCE_SCATTER(output, full, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return Handle(work, (output, full))

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Handle:
        """Concatenate every rank's ``shard`` into ``full``; ``shard`` may be a view of ``full``."""
        self._count("all_gather", full)
        if self._local:
            if shard.data_ptr() != full.data_ptr():
                full.copy_(shard)
            return Handle()
        work = _ALL_GATHER(full, shard, group=self.group, async_op=async_op)
        return Handle(work, (full, shard))

    def all_gather_check(self, full: torch.Tensor, mine: torch.Tensor) -> Handle:
        """An asynchronous all-gather of a few bookkeeping values (counted apart from the model's traffic)."""
        self._count("check", full)
        work = _ALL_GATHER(full, mine, group=self.group, async_op=True)
        return Handle(work, (full, mine))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of a small tensor (norms, overflow flags); ``op`` is sum or max."""
        if self.world_size > 1:
            reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            dist.all_reduce(tensor, op=reduce_op, group=self.group)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast from group rank ``src``."""
        if self.world_size > 1:
            self._count("broadcast", tensor)
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src) if self.group else src,
                           group=self.group)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Group rank ``src``'s picklable ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src) if self.group else src,
                                   group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        if dist.get_backend(self.group) == "nccl":
            dist.barrier(group=self.group, device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier(group=self.group)

    def reduce_value(self, tensor: torch.Tensor, op: Any = "mean") -> torch.Tensor:
        """Lightning's ``strategy.reduce`` (logged values, metrics): in place, ``op`` a ``ReduceOp`` or one of
        "sum", "mean"/"avg", "max", "min", "product"; a mean is a sum divided here (gloo has no AVG)."""
        if self.world_size == 1:
            return tensor
        divide = False
        if isinstance(op, str):
            name = op.lower()
            divide = name in ("mean", "avg")
            op = dist.ReduceOp.SUM if divide else getattr(dist.ReduceOp, name.upper())
        dist.all_reduce(tensor, op=op, group=self.group)
        if not divide:
            return tensor
        return tensor.div_(self.world_size) if tensor.is_floating_point() else tensor.copy_(tensor / self.world_size)

    def dcp_save(self, state: dict[str, Any], writer: Any) -> None:
        """``torch.distributed.checkpoint.save`` over this group (every rank writes its part)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=writer, process_group=self.group)

    def dcp_load(self, state: dict[str, Any], reader: Any) -> None:
        """``torch.distributed.checkpoint.load`` over this group (every rank reads what its tensors need)."""
        import torch.distributed.checkpoint as dcp

        dcp.load(state, storage_reader=reader, process_group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj`` (diagnostics only: slow, never on the hot path)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def host_group(self) -> Any:
        """A gloo group of these ranks, for collectives on host tensors (the group itself when it is gloo;
        created on first use: a collective call, every rank makes it)."""
        if self.host is None:
            if dist.get_backend(self.group) == "gloo":
                self.host = self.group if self.group is not None else dist.group.WORLD
            else:
                self.host = self._new_group("gloo")
        return self.host

    def all_to_all_host(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                        input_splits: list[int]) -> None:
        """Host tensors: ``input_splits[r]`` elements of ``input`` go to rank r, ``output_splits[r]`` arrive from it."""
        self._count("all_to_all", input)
        if self.world_size == 1:
            output.copy_(input)
            return
        dist.all_to_all_single(output, input, output_splits, input_splits, group=self.host_group())

    def mesh(self, device_type: str) -> Optional[Any]:
        """A 1-D DeviceMesh over these ranks for DTensors on ``device_type`` (host tensors: the gloo group);
        None without torch.distributed (a plain process: no DTensor can be made)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if device_type not in self.meshes:
            from torch.distributed.device_mesh import DeviceMesh

            group = self.host_group() if device_type == "cpu" else (self.group or dist.group.WORLD)
            self.meshes[device_type] = DeviceMesh.from_group(group, device_type)
        return self.meshes[device_type]

    def with_control(self) -> Comm:
        """This Comm plus a small gloo group for :meth:`rendezvous` (a collective call: every rank makes it)."""
        if self.world_size > 1 and dist.is_initialized() and self.control is None:
            self.control = self._new_group("gloo")
        return self

    def close_control(self) -> None:
        if self.control is not None and dist.is_initialized():
            dist.destroy_process_group(self.control)
        self.control = None
        if self.host is not None and self.host is not self.group and self.host is not dist.group.WORLD \
                and dist.is_initialized():
            dist.destroy_process_group(self.host)
        self.host = None
        self.meshes.clear()

    # [Note: a failure named on every rank] When the ranks' collectives fall out of step, each rank times out in a
    # collective of its own: the one in the engine's wait names the cause, another may wait in Lightning's logging
    # all-reduce and know nothing. The store, outside every group, carries the named cause to the others.
    _FAILURE_KEY = "lightning_zero/failure"

    def report_failure(self, message: str) -> None:
        """Leave ``message`` for the other ranks (see :meth:`reported_failure`); best effort."""
        store = _default_store() if self.world_size > 1 else None
        if store is not None:
            try:
                store.set(self._FAILURE_KEY, f"rank {self.rank}: {message}")
            except Exception:  # noqa: BLE001 - a broken store must not hide the rank's own error
                pass

    def reported_failure(self, wait_s: float) -> Optional[str]:
        """What another rank reported within ``wait_s`` seconds, or None."""
        store = _default_store() if self.world_size > 1 else None
        if store is None:
            return None
        try:
            store.wait([self._FAILURE_KEY], timedelta(seconds=wait_s))
            return store.get(self._FAILURE_KEY).decode()
        except Exception:  # noqa: BLE001 - nothing reported (a timeout) or no store left
            return None

    def rendezvous(self, what: str, timeout_s: float) -> None:
        """Every rank reaches ``what`` within ``timeout_s``, or each rank that did raises
        :class:`MissingRanksError` naming the others, instead of waiting forever in ``what``'s collectives."""
        if self.world_size == 1 or self.control is None:
            return
        try:
            dist.monitored_barrier(self.control, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as err:
            raise MissingRanksError(
                f"{what} is a collective: every rank must call it, and not every rank did within {timeout_s:g} s "
                f"(rank {self.rank} waited; {err}). Call it on all ranks (not under `if trainer.is_global_zero:`), "
                f"or raise ZeroConfig(rendezvous_timeout_s) if some ranks are just slow to get there.") from None

    def reset_counters(self) -> None:
        self.bytes_moved.clear()


def _default_store() -> Optional[Any]:
    """The default group's store (no public accessor in torch 2.11-2.13), or None."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None or not dist.is_initialized():
        return None
    try:
        return getter()
    except Exception:  # noqa: BLE001
        return None
