"""What the host can really give this process: the budget offload plans must fit in.

The machine's physical memory is not it. A container or a SLURM job runs under a cgroup limit
(v2 ``memory.max``, v1 ``memory.limit_in_bytes``) that the kernel enforces by killing the job,
without a message; memory already in use (the page cache excepted) is not free; and the ranks
of a node share what is left. Exceeding the budget is refused before anything is allocated,
with the bytes needed and available and the ways out, instead of an OOM kill that loses the run.

Everything reads files under ``root`` (``/`` here, a fake tree in the tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

__all__ = ["HostBudget", "read_host_budget", "HostMemoryError", "shortfall", "MARGIN", "GiB", "host_threads",
           "HEADROOM_SHARE", "HEADROOM_MIN", "first_step_shortfall"]

GiB = float(2**30)
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge page-rounded number


class HostMemoryError(MemoryError):
    """A placement needs more host memory than the host (its cgroup, its other ranks) can give."""


@dataclass(frozen=True)
class HostBudget:
    """Bytes of host memory one rank may plan for, and where the bound comes from."""

    per_rank: int
    node_free: int  # what the whole node (or the job's cgroup) can still give
    ranks_on_node: int
    mem_available: int
    cgroup_free: Optional[int]  # limit - usage of the tightest cgroup, None without a limit
    cgroup_limit: Optional[int]
    source: str  # "MemAvailable" or the cgroup file that bounds it
    headroom: int = 0  # of node_free, kept for the OS, the page cache and the job's small allocations (node-wide)
    returning: int = 0  # per rank: host bytes this rank holds now and gives back before the placement allocates

    @property
    def headroom_per_rank(self) -> int:
        return self.headroom // self.ranks_on_node

    def describe(self) -> str:
        limit = (f", cgroup limit {self.cgroup_limit / GiB:.1f} GiB with {self.cgroup_free / GiB:.1f} GiB free"
                 if self.cgroup_limit is not None else "")
        back = (f", plus {self.returning / GiB:.1f} GiB per rank held now and given back before the placement "
                f"allocates" if self.returning else "")
        return (f"{self.per_rank / GiB:.1f} GiB per rank ({self.node_free / GiB:.1f} GiB free on the node shared "
                f"by {self.ranks_on_node} rank(s); MemAvailable {self.mem_available / GiB:.1f} GiB{limit}{back}; "
                f"bound by {self.source})")


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text:
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _NO_LIMIT else value


def _meminfo(root: Path, key: str) -> Optional[int]:
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def mem_available(root: Path) -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (free memory plus what the kernel can reclaim), bytes."""
    found = _meminfo(root, "MemAvailable")
    return found if found is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def mem_total(root: Path) -> int:
    found = _meminfo(root, "MemTotal")
    return found if found is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_dirs(root: Path) -> list[tuple[Path, str, str, str]]:
    """(directory, limit file, usage file, inactive-file key) of every cgroup level this process is in,
    innermost first (v2 and v1 memory controller)."""
    out: list[tuple[Path, str, str, str]] = []
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2 unified hierarchy
            base, files = root / "sys/fs/cgroup", ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, files = root / "sys/fs/cgroup/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                           "total_inactive_file")
        else:
            continue
        # inside a cgroup namespace the mount's root is this process's own cgroup: try the path, then its parents
        rel_parts = [p for p in rel.strip("/").split("/") if p]
        for depth in range(len(rel_parts), -1, -1):
            directory = base.joinpath(*rel_parts[:depth])
            if (directory / files[0]).exists():
                out.append((directory, *files))
    return out


def _inactive_file(directory: Path, key: str) -> int:
    """Page cache the kernel reclaims before killing (counted in usage)."""
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_free(root: Path) -> tuple[Optional[int], Optional[int], str]:
    """(free, limit, file) of the tightest memory cgroup around this process; (None, None, "") without a limit."""
    best: tuple[Optional[int], Optional[int], str] = (None, None, "")
    for directory, limit_file, usage_file, inactive in _cgroup_dirs(root):
        limit = _read_int(directory / limit_file)
        if limit is None:
            continue
        usage = _read_int(directory / usage_file) or 0
        free = max(0, limit - usage + _inactive_file(directory, inactive))
        if best[0] is None or free < best[0]:
            best = (free, limit, str((directory / limit_file).relative_to(root)))
    return best


def read_host_budget(ranks_on_node: int = 1, root: Any = None, returning: int = 0) -> HostBudget:
    """What each of the node's ``ranks_on_node`` ranks may plan to allocate on the host, from
    ``MemAvailable`` and the tightest cgroup limit (``root``: where /proc and /sys are; the
    ``LIGHTNING_ZERO_HOST_ROOT`` environment variable, else ``/``). ``returning``: bytes each rank holds now
    and frees before the placement allocates its own (a module built in host memory, which the engine copies
    to the GPU unit by unit; a placement being replaced): they count as free."""
    root = Path(root if root is not None else os.environ.get("LIGHTNING_ZERO_HOST_ROOT", "/"))
    available = mem_available(root)
    free, limit, source = cgroup_free(root)
    node_free, bound, total = available, "MemAvailable (/proc/meminfo)", mem_total(root)
    if free is not None and free < available:
        node_free, bound, total = free, f"the cgroup limit (/{source})", limit
    ranks = max(1, int(ranks_on_node))
    node_free += max(0, int(returning)) * ranks  # every rank of the node holds (and gives back) its own copy
    return HostBudget(per_rank=node_free // ranks, node_free=node_free, ranks_on_node=ranks,
                      mem_available=available, cgroup_free=free, cgroup_limit=limit, source=bound,
                      headroom=int(max(HEADROOM_MIN, HEADROOM_SHARE * (total or 0))), returning=max(0, int(returning)))


MARGIN = 0.05  # measured host use above the plan: 112.0 GiB RSS against 108.3 planned (13B, zero3 offload 55%)
# Never plan the last bytes: the kernel kills the job (no message) before MemAvailable reaches 0, and the
# interpreter, the CUDA context, a dataloader worker, the page cache of a checkpoint all want some.
HEADROOM_SHARE = 0.03  # of the memory that bounds the budget (the cgroup limit, else MemTotal)
HEADROOM_MIN = 256 * 2**20
_WAYS_OUT = ("Ways out: a smaller offload_fraction (the rest stays on the GPU), offload_optimizer='nvme' with "
             "nvme_path=DIR, fewer ranks per node or more nodes, or a larger memory limit for the job.")


def shortfall(needed: int, budget: HostBudget, what: str) -> Optional[str]:
    """None when ``needed`` bytes (plus the margin) fit this rank's budget less its share of the headroom, else
    the one-line refusal."""
    if needed * (1 + MARGIN) + budget.headroom_per_rank <= budget.per_rank:
        return None
    return (f"{what} needs {needed / GiB:.1f} GiB of host memory per rank (+{MARGIN:.0%} margin, and "
            f"{budget.headroom_per_rank / GiB:.2f} GiB left to the system) and the host can give "
            f"{budget.describe()}. {_WAYS_OUT}")


def first_step_shortfall(pending: int, budget: HostBudget) -> Optional[str]:
    """Checked again just before the first step: what the step still allocates (``pending`` bytes, the optimizer
    state torch creates lazily) against what the host can give now; dataloader workers or other processes may
    have taken memory since setup. None when it fits, else the one-line refusal."""
    if pending + budget.headroom_per_rank <= budget.per_rank:
        return None
    return (f"lightning_zero: the first optimizer step would allocate {pending / GiB:.2f} GiB of host memory per "
            f"rank (the optimizer state of the offloaded units, planned at setup) and the host can now give "
            f"{budget.describe()}, {budget.headroom_per_rank / GiB:.2f} GiB of it left to the system: memory was "
            f"taken since setup (dataloader workers: fewer num_workers; other processes on the node). Stopping "
            f"here instead of being killed by the kernel mid-step. {_WAYS_OUT}")


def speculation_room(backup: int, pending: int, budget: HostBudget) -> Optional[str]:
    """Whether the copy a speculative host step keeps (``backup`` bytes per rank) fits beside what the first
    step still allocates (``pending``); None when it does, else why not (the host step then waits for backward)."""
    if backup + pending + budget.headroom_per_rank <= budget.per_rank:
        return None
    return (f"no host memory for the speculative step's copy of the offloaded state ({backup / GiB:.2f} GiB per "
            f"rank; the host can give {budget.describe()})")


LOOP_CORES = 2  # cores a rank with a large share leaves to its training loop and copy threads


def host_threads(cores: int, ranks_on_node: int, current: int, user_set: bool) -> Optional[int]:
    """The intra-op threads one rank's host optimizer step should use: its share of the node's cores (the host
    step is bound by memory bandwidth, and ranks that each start one thread per core of the node oversubscribe
    it), less two where the share is large: the training loop's thread launches the GPU's kernels and the copy
    threads feed it while the host step runs, and a host step on every core starves them (1.3B on an H100 host
    of 16 cores: 14 threads gave 37,464 tokens/s, 16 gave 35,425). None: leave torch's setting (the user chose
    one, or it is already no more than that)."""
    share = max(1, cores // max(1, ranks_on_node))
    if share > 4:
        share -= LOOP_CORES
    if user_set or current <= share:
        return None
    return share
