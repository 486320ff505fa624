"""Comm over real gloo process groups on CPU (world sizes 2 and 3), plus the world-size-1 shortcut.

One spawn per world size runs every check on every rank; each check does all of its
collectives first and its assertions afterwards, so a failed check cannot desynchronise the
ranks. Results come back as one JSON file per rank and are asserted per check below.
Expected values are computed by brute force from every rank's (regenerable) inputs.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_zero.collectives import Comm, Handle

SPAWN_DEADLINE_S = 60.0


def _inputs(rank: int, numel: int, dtype: torch.dtype, lo: int = -8, hi: int = 9) -> torch.Tensor:
    """Rank ``rank``'s input: small integers, exact in every dtype and in sums over a few ranks."""
    g = torch.Generator().manual_seed(1000 + rank * 17 + numel)
    return torch.randint(lo, hi, (numel,), generator=g).to(dtype)


def _expected_sum(world: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    total = torch.zeros(numel, dtype=torch.float64)
    for q in range(world):
        total += _inputs(q, numel, dtype).double()
    return total


# --- checks (run inside each rank) --------------------------------------------------------------
# Each takes (comm, rank, world) and raises AssertionError on failure.

CHUNK = 7  # odd on purpose: nothing may assume aligned chunk sizes


def _check_reduce_scatter(dtype: torch.dtype, async_op: bool):
    def check(comm, rank, world):
        full = _inputs(rank, world * CHUNK, dtype)
        out = torch.full((CHUNK,), 12345.0, dtype=dtype)
        handle = comm.reduce_scatter(out, full, async_op=async_op)
        assert isinstance(handle, Handle)
        handle.wait()
        handle.wait()  # idempotent
        expected = _expected_sum(world, world * CHUNK, dtype)[rank * CHUNK:(rank + 1) * CHUNK]
        assert out.dtype == dtype
        assert torch.equal(out.double(), expected), (out, expected)

    return check


def _check_all_gather(dtype: torch.dtype, async_op: bool, in_place: bool):
    def check(comm, rank, world):
        full = torch.full((world * CHUNK,), float("nan"), dtype=dtype)
        mine = _inputs(rank, CHUNK, dtype)
        if in_place:
            shard = full[rank * CHUNK:(rank + 1) * CHUNK]
            shard.copy_(mine)
        else:
            shard = mine.clone()
        ptr = full.data_ptr()
        handle = comm.all_gather(full, shard, async_op=async_op)
        handle.wait()
        assert full.data_ptr() == ptr  # written in place, not rebound
        expected = torch.cat([_inputs(q, CHUNK, dtype) for q in range(world)])
        assert not torch.isnan(full.float()).any(), full
        assert torch.equal(full, expected), (full, expected)
        if in_place:
            assert torch.equal(shard, mine)

    return check


def _check_async_overlap(comm, rank, world):
    # several collectives in flight at once, waited in reverse order
    fulls = [_inputs(rank, world * CHUNK, torch.float32) + i for i in range(3)]
    outs = [torch.empty(CHUNK) for _ in range(3)]
    handles = [comm.reduce_scatter(o, f, async_op=True) for o, f in zip(outs, fulls)]
    gathered = torch.empty(world * 3)
    ag = comm.all_gather(gathered, torch.full((3,), float(rank)), async_op=True)
    for h in reversed(handles):
        h.wait()
    ag.wait()
    assert ag.keep == ()  # released after wait
    base = _expected_sum(world, world * CHUNK, torch.float32)[rank * CHUNK:(rank + 1) * CHUNK]
    for i, out in enumerate(outs):
        assert torch.equal(out.double(), base + i * world), (i, out)
    assert torch.equal(gathered, torch.arange(world).float().repeat_interleave(3))


def _check_all_reduce(comm, rank, world):
    vals = [torch.tensor([q + 1.0, -float(q), float(q * q), 0.5]) for q in range(world)]
    t_sum = vals[rank].clone()
    r_sum = comm.all_reduce(t_sum)
    t_max = vals[rank].clone()
    r_max = comm.all_reduce(t_max, op="max")
    flag = torch.tensor([1.0 if rank == world - 1 else 0.0])  # overflow vote: one rank saw inf
    comm.all_reduce(flag, op="max")
    assert r_sum is t_sum and r_max is t_max  # in place
    assert torch.equal(t_sum, torch.stack(vals).sum(0)), t_sum
    assert torch.equal(t_max, torch.stack(vals).max(0).values), t_max
    assert flag.item() == 1.0


def _check_broadcast(comm, rank, world):
    payload = torch.arange(11, dtype=torch.float32) * 3 - 5
    results = []
    for src in (0, world - 1):
        t = payload.clone() + src if rank == src else torch.zeros(11)
        out = comm.broadcast(t, src=src)
        results.append((src, t, out))
    for src, t, out in results:
        assert out is t
        assert torch.equal(t, payload + src), (src, t)


def _check_counters(comm, rank, world):
    c = Comm(comm.rank, comm.world_size, comm.group)
    assert sum(c.bytes_moved.values()) == 0
    rs_full = torch.ones(world * 10, dtype=torch.float32)
    c.reduce_scatter(torch.empty(10), rs_full).wait()
    c.reduce_scatter(torch.empty(10), rs_full, async_op=True).wait()
    ag_full = torch.empty(world * 6, dtype=torch.bfloat16)
    c.all_gather(ag_full, ag_full[rank * 6:(rank + 1) * 6]).wait()
    b = torch.zeros(5, dtype=torch.float64)
    c.broadcast(b)
    counts = dict(c.bytes_moved)
    c.reset_counters()
    after_reset = sum(c.bytes_moved.values())
    assert counts["reduce_scatter"] == 2 * world * 10 * 4, counts
    assert counts["all_gather"] == world * 6 * 2, counts
    assert counts["broadcast"] == 5 * 8, counts
    assert after_reset == 0


def _check_from_group(comm, rank, world):
    assert comm.rank == rank and comm.world_size == world
    assert comm.backend == "gloo"


def _check_subgroup(comm, rank, world):
    # Every rank must take part in new_group. Members: global ranks 1..world-1.
    members = list(range(1, world))
    group = dist.new_group(members)
    if rank not in members:
        return
    sub = Comm.from_group(group)
    grank, gworld = members.index(rank), len(members)
    assert (sub.rank, sub.world_size) == (grank, gworld)
    # broadcast from the LAST group rank: a group rank, not a global one
    src = gworld - 1
    t = torch.full((4,), 100.0 + rank) if grank == src else torch.zeros(4)
    sub.broadcast(t, src=src)
    full = _inputs(rank, gworld * CHUNK, torch.float32)
    out = torch.empty(CHUNK)
    sub.reduce_scatter(out, full).wait()
    gathered = torch.empty(gworld * 2)
    sub.all_gather(gathered, torch.full((2,), float(rank))).wait()
    s = torch.tensor([float(rank)])
    sub.all_reduce(s)
    assert torch.equal(t, torch.full((4,), 100.0 + members[src])), t
    expected = torch.zeros(gworld * CHUNK, dtype=torch.float64)
    for q in members:
        expected += _inputs(q, gworld * CHUNK, torch.float32).double()
    assert torch.equal(out.double(), expected[grank * CHUNK:(grank + 1) * CHUNK])
    assert torch.equal(gathered, torch.tensor(members, dtype=torch.float32).repeat_interleave(2))
    assert s.item() == sum(members)


def _check_sibling_does_not_queue(comm, rank, world):
    # Rank 0 issues a reduce-scatter and, while it is still in flight, an all-gather on the sibling
    # group; the other ranks join the all-gather first and the reduce-scatter only after it. On one
    # shared group the all-gather would queue behind the reduce-scatter and never complete.
    side = comm.sibling()
    assert side.group is not comm.group and (side.rank, side.world_size) == (rank, world)
    full, out, gathered = torch.ones(world * CHUNK), torch.empty(CHUNK), torch.empty(world * 2)
    if rank == 0:
        handle = comm.reduce_scatter(out, full, async_op=True)
        side.all_gather(gathered, torch.full((2,), float(rank))).wait()
        handle.wait()
    else:
        side.all_gather(gathered, torch.full((2,), float(rank))).wait()
        comm.reduce_scatter(out, full).wait()
    assert torch.equal(gathered, torch.arange(world, dtype=torch.float32).repeat_interleave(2))
    assert torch.equal(out, torch.full((CHUNK,), float(world)))


CHECKS = {
    "sibling_does_not_queue": _check_sibling_does_not_queue,
    "reduce_scatter_fp32": _check_reduce_scatter(torch.float32, False),
    "reduce_scatter_fp32_async": _check_reduce_scatter(torch.float32, True),
    "reduce_scatter_bf16": _check_reduce_scatter(torch.bfloat16, False),
    "reduce_scatter_bf16_async": _check_reduce_scatter(torch.bfloat16, True),
    "reduce_scatter_fp16": _check_reduce_scatter(torch.float16, False),
    "all_gather_in_place_fp32": _check_all_gather(torch.float32, False, True),
    "all_gather_in_place_fp32_async": _check_all_gather(torch.float32, True, True),
    "all_gather_in_place_bf16": _check_all_gather(torch.bfloat16, False, True),
    "all_gather_in_place_bf16_async": _check_all_gather(torch.bfloat16, True, True),
    "all_gather_separate_shard": _check_all_gather(torch.float32, False, False),
    "async_overlap": _check_async_overlap,
    "all_reduce_sum_max": _check_all_reduce,
    "broadcast": _check_broadcast,
    "byte_counters": _check_counters,
    "from_group": _check_from_group,
    "subgroup": _check_subgroup,
}


def _worker(rank: int, world: int, port: int, outdir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    results = {}
    try:
        comm = Comm.from_group()
        for name, check in CHECKS.items():
            try:
                check(comm, rank, world)
                results[name] = "ok"
            except Exception:  # noqa: BLE001 - report every check, keep the ranks in step
                results[name] = traceback.format_exc()
        dist.barrier()
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def gloo_results(request, tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo not available")
    world = request.param
    outdir = tmp_path_factory.mktemp(f"gloo{world}")
    ctx = mp.spawn(_worker, args=(world, _free_port(), str(outdir)), nprocs=world, join=False)
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    error = None
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                error = f"world {world}: workers did not finish in {SPAWN_DEADLINE_S} s"
                break
    except Exception as exc:  # noqa: BLE001 - surfaced per test below
        error = f"world {world}: a worker failed: {exc}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    results = []
    for rank in range(world):
        path = outdir / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return world, results, error


@pytest.mark.slow
@pytest.mark.parametrize("check", list(CHECKS))
def test_gloo(gloo_results, check: str) -> None:
    world, results, error = gloo_results
    failures = []
    for rank, res in enumerate(results):
        status = res.get(check, f"not run ({error})")
        if status != "ok":
            failures.append(f"--- world {world} rank {rank} ---\n{status}")
    assert not failures, "\n".join(failures)


# --- world size 1: no process group at all ------------------------------------------------------


def test_world_size_one_needs_no_process_group() -> None:
    if dist.is_initialized():  # left by an in-process Trainer(devices=1) test
        dist.destroy_process_group()
    comm = Comm.from_group()
    assert (comm.rank, comm.world_size) == (0, 1)
    assert comm.backend == "none"

    full = torch.arange(9, dtype=torch.float32)
    out = torch.empty(9)
    h = comm.reduce_scatter(out, full, async_op=True)
    h.wait()
    h.wait()
    assert torch.equal(out, full) and out.data_ptr() != full.data_ptr()

    # all_gather with the shard a view of the full buffer: nothing to do, data intact
    buf = torch.arange(6, dtype=torch.bfloat16)
    comm.all_gather(buf, buf[0:6], async_op=True).wait()
    assert torch.equal(buf, torch.arange(6, dtype=torch.bfloat16))
    # separate shard: copied
    dst = torch.zeros(4)
    comm.all_gather(dst, torch.tensor([1.0, 2.0, 3.0, 4.0])).wait()
    assert torch.equal(dst, torch.tensor([1.0, 2.0, 3.0, 4.0]))

    t = torch.tensor([3.0, -1.0])
    assert comm.all_reduce(t) is t and torch.equal(t, torch.tensor([3.0, -1.0]))
    assert comm.all_reduce(t, op="max") is t and torch.equal(t, torch.tensor([3.0, -1.0]))
    assert comm.broadcast(t) is t and torch.equal(t, torch.tensor([3.0, -1.0]))
    assert comm.all_gather_object({"a": 1}) == [{"a": 1}]
    assert not dist.is_initialized()


def test_world_size_one_counts_reduce_scatter_and_all_gather() -> None:
    comm = Comm()
    comm.reduce_scatter(torch.empty(8), torch.ones(8))
    comm.all_gather(torch.empty(4, dtype=torch.float16), torch.ones(4, dtype=torch.float16))
    assert comm.bytes_moved["reduce_scatter"] == 8 * 4
    assert comm.bytes_moved["all_gather"] == 4 * 2
    comm.reset_counters()
    assert sum(comm.bytes_moved.values()) == 0


def test_handle_without_work() -> None:
    keep = (torch.ones(1),)
    h = Handle(None, keep)
    h.wait()
    assert h.keep == ()
