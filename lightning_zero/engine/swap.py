"""NVMe offload: optimizer state and parameter shards in files, streamed through bounded staging.

[Note: files and staging]
Each offloaded unit keeps one file per elementwise tensor (``master``, each optimizer state key
such as ``exp_avg``, and for stage 3 the compute-dtype parameter shard). Between steps these
are memory-mapped views, so every reader that is not the step (checkpoints, consolidation,
``full_state_dict``) sees real values without loading them all. The step never touches the
mappings: chunks of units are read with ``pread`` into one of three page-locked staging slots
(one being stepped, the next being read, the previous being written back with ``pwrite``), so
host memory for the optimizer side is the staging budget whatever the model size. Mapped
pages a reader touched are released again with ``madvise(MADV_DONTNEED)``; the data stays in
the file.
"""

from __future__ import annotations

import mmap
import multiprocessing.util
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch
from torch.profiler import record_function

from .flat_unit import FlatUnit
from .host import HostArena

__all__ = ["NvmePathError", "NvmeBackend", "resolve_nvme_dir", "SLOTS"]

SLOTS = 3  # staging slots: stepping, reading ahead, writing behind
ASSUMED_STATE_KEYS = 2  # before the first step: Adam's two moments


class NvmePathError(ValueError):
    """The NVMe offload directory is missing, not writable or too small."""


def resolve_nvme_dir(path: Optional[str], need_bytes: int) -> Path:
    """The directory NVMe offload writes to (``nvme_path`` or $LIGHTNING_ZERO_NVME_PATH), checked."""
    raw = path or os.environ.get("LIGHTNING_ZERO_NVME_PATH")
    if not raw:
        raise NvmePathError("NVMe offload needs a directory: set ZeroConfig(nvme_path=...) (Hydra: "
                            "strategy.nvme_path=/local/nvme) or the LIGHTNING_ZERO_NVME_PATH environment variable.")
    root = Path(raw).expanduser()
    if not root.is_dir():
        raise NvmePathError(f"nvme_path '{root}' does not exist or is not a directory: create it, or point nvme_path "
                            f"at a directory on a local NVMe disk.")
    try:  # a real probe: permission bits say nothing for root or for a read-only mount
        os.rmdir(tempfile.mkdtemp(prefix=".lightning_zero-probe-", dir=root))
    except OSError as err:
        raise NvmePathError(f"nvme_path '{root}' is not writable by this process ({err.strerror}): choose a directory "
                            f"you can write to on a local NVMe disk.") from None
    free = shutil.disk_usage(root).free
    if free < need_bytes:
        raise NvmePathError(f"nvme_path '{root}' has {free / 2**30:.2f} GiB free; NVMe offload of this model needs "
                            f"{need_bytes / 2**30:.2f} GiB on this rank: free space there, pick a larger disk, or "
                            f"offload less (offload_fraction, offload_optimizer='cpu').")
    return root


class MappedFile:
    """A file of ``numel`` elements with a shared mapping viewed as a tensor."""

    def __init__(self, path: Path, numel: int, dtype: torch.dtype) -> None:
        self.path = path
        self.nbytes = max(numel, 1) * torch.empty((), dtype=dtype).element_size()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, self.nbytes)
        self.map = mmap.mmap(self.fd, self.nbytes)
        self.tensor = torch.frombuffer(self.map, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)

    def read_into(self, out: torch.Tensor) -> None:
        os.preadv(self.fd, [_bytes_of(out)], 0)

    def write_from(self, src: torch.Tensor) -> None:
        os.pwrite(self.fd, _bytes_of(src), 0)

    def release_pages(self) -> None:
        """Drop this process's resident pages of the mapping (the file keeps the data)."""
        self.map.madvise(mmap.MADV_DONTNEED)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().view(torch.uint8).numpy())


class NvmeBackend:
    """The files and staging slots of one rank's NVMe-offloaded units.

    With ``masters`` it is the offload backend of the optimizer side (the interface of
    :class:`lightning_zero.engine.host.HostBackend`: ``chunks`` and ``run``, which stages each chunk
    in from its files, steps it and writes it back); it may also hold only the stage-3 parameter-shard
    files (``params_dtype``).

    Args:
        units: the offloaded units (their masters are still in memory when this is built).
        root: the checked directory (:func:`resolve_nvme_dir`).
        rank: names this rank's subdirectory.
        budget_bytes: host memory for the staging slots (``nvme_buffer_bytes``).
        pin: page-lock the staging memory.
        params_dtype: stage 3 with ``offload_params='nvme'``: dtype of the parameter-shard files.
    """

    def __init__(self, units: Sequence[FlatUnit], root: Path, rank: int, budget_bytes: int, pin: bool,
                 masters: bool = True, params_dtype: Optional[torch.dtype] = None) -> None:
        self.dir = root / f"lightning_zero-{uuid.uuid4().hex[:12]}-rank{rank}"
        self.dir.mkdir()
        # Removed when the store is collected, closed, or the process exits. multiprocessing's
        # Finalize (not weakref.finalize/atexit) because ranks started by fork or forkserver
        # (Lightning's ddp_fork / ddp_notebook) end with os._exit, which skips atexit but still runs
        # these finalizers; a normal interpreter exit runs them too.
        self._cleanup = multiprocessing.util.Finalize(self, shutil.rmtree, args=(str(self.dir), True),
                                                      exitpriority=10)
        self.steps_in_place = False  # a unit's state is in its files until ``run`` stages it
        self.units = list(units)
        self.files: dict[tuple[int, str], MappedFile] = {}
        self.state_keys: list[str] = []
        self.budget_bytes = budget_bytes
        self.slot_numel = budget_bytes // 4 // SLOTS
        need = max((u.layout.shard_numel for u in self.units), default=0) * (1 + ASSUMED_STATE_KEYS)
        if need > self.slot_numel:
            self._too_small(need)
        self.masters = masters
        self.staging = HostArena([self.slot_numel] * SLOTS if masters else [0], torch.float32, pin)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lz-nvme")
        for unit in self.units:
            if masters:
                master = self._file(unit, "master", torch.float32)
                master.tensor.copy_(unit.master)
                unit.set_master(master.tensor)
                master.release_pages()
            if params_dtype is not None:
                shard = self._file(unit, "param", params_dtype)
                unit.set_param_shard(shard.tensor, shard.release_pages)

    @staticmethod
    def first_step_bytes(budget_bytes: int) -> int:
        """Host bytes beyond the staging slots during the first step: the state the optimizer creates lazily for one
        chunk (Adam's two moments over at most a slot's third), held until that chunk's files are written."""
        return 4 * ASSUMED_STATE_KEYS * (budget_bytes // 4 // SLOTS) // (1 + ASSUMED_STATE_KEYS)

    def _too_small(self, need_numel: int) -> None:
        raise NvmePathError(
            f"nvme_buffer_bytes={self.budget_bytes} is too small: the largest offloaded unit needs "
            f"{need_numel * 4 / 2**10:.0f} KiB per staging slot (fp32 master and optimizer state) and NVMe offload "
            f"uses {SLOTS} slots; set "
            f"nvme_buffer_bytes to at least {need_numel * 4 * SLOTS} or make units smaller (reduce_bucket_size, "
            f"wrap_modules).")

    def _file(self, unit: FlatUnit, key: str, dtype: torch.dtype) -> MappedFile:
        f = self.files.get((unit.index, key))
        if f is None:
            f = self.files[(unit.index, key)] = MappedFile(self.dir / f"u{unit.index}.{key}.bin",
                                                           unit.layout.shard_numel, dtype)
        return f


    def chunks(self, units: Sequence[FlatUnit]) -> list[list[FlatUnit]]:
        """Consecutive units whose master and state fit one staging slot together."""
        per = 1 + max(len(self.state_keys), ASSUMED_STATE_KEYS)
        out: list[list[FlatUnit]] = []
        used = 0
        for unit in units:
            n = unit.layout.shard_numel * per
            if n > self.slot_numel:
                self._too_small(n)
            if not out or used + n > self.slot_numel:
                out.append([])
                used = 0
            out[-1].append(unit)
            used += n
        return out

    # ---- one step over the offloaded units ----------------------------------------------------
    def run(self, optimizer: torch.optim.Optimizer, chunks: list[list[FlatUnit]],
            body: Callable[[list[FlatUnit]], Optional[Any]]) -> None:
        """For each chunk: stage it (read ahead), run ``body`` (step + publish), write it back (behind).

        ``body`` returns a CUDA event (or None) after which the slot's memory may be reused.
        """
        reads: dict[int, Future] = {}
        writes: dict[int, Future] = {}
        events: dict[int, Any] = {}
        layouts = [self._layout(chunk) for chunk in chunks]

        def start_read(i: int) -> None:
            slot = i % SLOTS
            if slot in writes:
                writes.pop(slot).result()
            if events.get(slot) is not None:
                events.pop(slot).synchronize()
            reads[i] = self._pool.submit(self._read, layouts[i], self.staging.views[slot], optimizer)

        if chunks:
            start_read(0)
        for i, chunk in enumerate(chunks):
            if i + 1 < len(chunks):
                start_read(i + 1)
            reads.pop(i).result()
            slot = i % SLOTS
            self._swap_in(optimizer, layouts[i], self.staging.views[slot])
            events[slot] = body(chunk)
            new_keys = self._swap_out(optimizer, layouts[i], self.staging.views[slot])
            writes[slot] = self._pool.submit(self._write, layouts[i], self.staging.views[slot], new_keys, events[slot])
            if new_keys:  # state the optimizer just created (its first step) lives outside the slots until written:
                writes.pop(slot).result()  # one chunk of it at a time (first_step_bytes), not every chunk in flight
        for future in writes.values():
            future.result()
        for f in self.files.values():
            f.release_pages()

    def _layout(self, chunk: list[FlatUnit]) -> list[tuple[FlatUnit, str, int]]:
        """(unit, key, offset in the slot) for the master and every known state key of the chunk."""
        out, offset = [], 0
        for key in ["master", *self.state_keys]:
            for unit in chunk:
                if (unit.index, key) in self.files:
                    out.append((unit, key, offset))
                offset += unit.layout.shard_numel
        return out

    def _read(self, layout: list, staging: torch.Tensor, optimizer: Any) -> None:
        with record_function("zero/nvme_read"):
            self._read_all(layout, staging)

    def _read_all(self, layout: list, staging: torch.Tensor) -> None:
        for unit, key, offset in layout:
            self.files[(unit.index, key)].read_into(staging[offset:offset + unit.layout.shard_numel])

    def _swap_in(self, optimizer: Any, layout: list, staging: torch.Tensor) -> None:
        for unit, key, offset in layout:
            flat = staging[offset:offset + unit.layout.shard_numel]
            if key == "master":
                unit.set_master(flat)
            else:
                self._point_state(optimizer, unit, key, flat)

    def _swap_out(self, optimizer: Any, layout: list, staging: torch.Tensor) -> list[tuple[FlatUnit, str, list]]:
        """Point everything back at the mapped files; returns state the step created (a first step)."""
        created: list[tuple[FlatUnit, str, list]] = []
        units = {u.index: u for u, _, _ in layout}
        staged = staging.untyped_storage().data_ptr()
        for unit in units.values():
            by_key: dict[str, list] = {}
            for piece, where in zip(unit.pieces, unit.spans):
                for key, value in (optimizer.state.get(piece, {}) if piece is not None else {}).items():
                    if _elementwise(value, piece) and value.untyped_storage().data_ptr() != staged:
                        by_key.setdefault(key, []).append((where, value))
            for key, values in by_key.items():
                if key not in self.state_keys:
                    self.state_keys.append(key)
                created.append((unit, key, values))
        for unit, key, _ in layout:
            target = self.files[(unit.index, key)].tensor
            if key == "master":
                unit.set_master(target)
            else:
                self._point_state(optimizer, unit, key, target)
        for unit, key, _ in created:
            self._point_state(optimizer, unit, key, self._file(unit, key, torch.float32).tensor)
        return created

    def _write(self, layout: list, staging: torch.Tensor, created: list, event: Any) -> None:
        with record_function("zero/nvme_write"):
            self._write_all(layout, staging, created, event)

    def _write_all(self, layout: list, staging: torch.Tensor, created: list, event: Any) -> None:
        if event is not None:
            event.synchronize()
        for unit, key, offset in layout:
            self.files[(unit.index, key)].write_from(staging[offset:offset + unit.layout.shard_numel])
        for unit, key, values in created:
            f = self.files[(unit.index, key)]
            for where, value in values:
                os.pwrite(f.fd, _bytes_of(value.reshape(-1)), where.shard_start * 4)

    @staticmethod
    def _point_state(optimizer: Any, unit: FlatUnit, key: str, flat: torch.Tensor) -> None:
        for piece, where in zip(unit.pieces, unit.spans):
            if piece is None:
                continue
            state = optimizer.state.get(piece)
            if state is not None and key in state:
                state[key] = flat[where.shard_start:where.shard_start + where.length]

    def close(self) -> None:
        """Remove this rank's files (the engine is released)."""
        self._pool.shutdown(wait=True)
        self.files.clear()
        self._cleanup()


def _elementwise(value: Any, piece: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == piece.shape and value.dtype == torch.float32
