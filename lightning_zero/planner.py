"""The placement planner: per-rank bytes on GPU, host and NVMe for each ZeRO configuration.

Pure arithmetic, no torch.distributed. It counts what lightning_zero allocates, not only the
paper's formulas: the fp32 gradient shard (exact accumulation), stage 1's full gradients of a
window, the in-flight reduce buckets, the stage-3 gathered working set, the device-side
accumulator offload keeps during accumulation, pinned host arenas, NVMe staging slots and the
CUDA context. Activations come from the caller (a measured probe step, or an estimate).

``plan(...)`` gives one :class:`Placement` per candidate; ``choose`` picks the one with the least
traffic that fits (``strategy="zero_auto"``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional

from .config import ZeroConfig

__all__ = ["Hardware", "Placement", "plan", "estimate", "choose", "hardware_here", "CANDIDATES", "CUDA_CONTEXT_BYTES"]

GiB = float(2**30)
CUDA_CONTEXT_BYTES = int(0.6 * GiB)  # context + cuBLAS workspaces, measured on the H200 (not in max_memory_allocated)
HEADROOM = 0.92  # share of GPU / host memory a plan may fill (fragmentation, the framework itself)


@dataclass(frozen=True)
class Hardware:
    """What one node offers (bytes) and how fast it moves data."""

    gpus_per_node: int = 1
    nodes: int = 1
    gpu_bytes: int = int(139 * GiB)
    host_bytes: int = int(125 * GiB)
    nvme_bytes: int = 0
    gpu_tflops: float = 790.0  # dense bf16 peak
    pcie_gbps: float = 51.0  # each way, GB/s
    cpu_step_params_per_s: float = 4.1e9  # fused CPU AdamW, whole node
    nvme_gbps: float = 1.5
    device_name: str = "GPU"  # what a rank computes on ("CPU" in CPU training, where its memory is the host's)

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class Placement:
    """Per-rank memory of one configuration and its expected bottleneck."""

    name: str
    config: Optional[ZeroConfig]
    gpu_state: int = 0  # model states + buffers the engine holds on the GPU
    gpu_buffers: int = 0  # of which transient: reduce buckets, the stage-3 gathered working set
    gpu_total: int = 0  # + activations + CUDA context
    host: int = 0  # per rank
    nvme: int = 0  # per rank
    activations: int = 0
    fits: bool = True
    bottleneck: str = "GPU compute"
    seconds: dict[str, float] = field(default_factory=dict)
    why: str = ""

    gpu_total_cap: int = 0
    runner_up: Optional[Placement] = None  # choose(): the next placement that fits

    @property
    def free_for_activations(self) -> int:
        return self.gpu_total_cap - self.gpu_state - CUDA_CONTEXT_BYTES


def estimate(num_params: int, config: Optional[ZeroConfig], hw: Hardware, *, compute_bytes: int = 2,
             state_bytes: int = 8, largest_unit: int = 0, activations: int = 0, tokens_per_step: int = 0,
             accumulate: int = 1) -> Placement:
    """Bytes per rank for ``config`` (None: DDP with fp32 parameters under autocast).

    Args:
        num_params: Ψ, trainable parameters.
        compute_bytes: 2 for bf16/fp16 modules, 4 for fp32.
        state_bytes: optimizer state per parameter (AdamW: two fp32 moments = 8).
        largest_unit: elements of the largest stage-3 group (gathered working set); 0: Ψ/24.
        activations: measured or estimated activation bytes of one micro-batch.
        tokens_per_step: for the time estimate (6Ψ FLOPs a token).
        accumulate: micro-batches per step (offload keeps a device accumulator when > 1).
    """
    n, w = num_params, hw.world
    p = compute_bytes
    master = 4 if p != 4 else 0  # fp32 compute: the master is the parameter itself (stages 1/2)
    name = "ddp" if config is None else placement_name(config)
    out = Placement(name=name, config=config, activations=activations, gpu_total_cap=int(hw.gpu_bytes * HEADROOM))
    if config is None:  # DDP under autocast: fp32 parameters, fp32 gradients, the optimizer state
        out.gpu_state = int((4 + 4 + state_bytes) * n + 25e6 * 4)  # + DDP's 25 MB buckets
    else:
        f = config.offload_fraction if config.offloads else 0.0
        shard = n / w
        bucket = 3 * config.reduce_bucket_size * p  # max_inflight + 1 full-size reduce buffers
        if config.shard_params:
            unit = largest_unit or n // 24
            gathered = (config.prefetch + 1) * unit * p + (2 * unit * p if config.activation_checkpointing else 0)
            opt_side = (4 + 4 + state_bytes) * shard  # master, fp32 gradient shard, state
            params_dev = (p * shard) * f if config.offload_params == "none" else 0  # offloaded units' gather source
            out.gpu_state = int(opt_side * (1 - f) + params_dev + gathered + bucket)
            out.gpu_buffers = int(gathered + bucket)
        else:
            # stage 1 accumulating: a window's full gradients (in grad_accum_dtype) live until its reduction
            full_grads = _accum_bytes(config, p) * n if config.stage == 1 and accumulate > 1 else 0
            opt_side = (master + 4 + state_bytes) * shard  # fp32 compute: the parameter is the master
            out.gpu_state = int(p * n + full_grads + opt_side * (1 - f) + bucket)
            out.gpu_buffers = int(full_grads + bucket)
        if f and accumulate > 1 and config.offload_accumulation == "device":
            out.gpu_state += int(4 * shard * f)  # device accumulator of the offloaded gradients
        host_state = int(f * shard * (4 + 4 + state_bytes))
        if config.offload_optimizer == "nvme":
            out.nvme = int(f * shard * (4 + state_bytes))
            from .engine.swap import NvmeBackend  # its slot layout decides the first step's transient

            # gradient shard + staging slots + the first step's lazily created state of one chunk
            out.host = (int(f * shard * 4) + config.nvme_buffer_bytes
                        + NvmeBackend.first_step_bytes(config.nvme_buffer_bytes))
        else:
            out.host = host_state
        if config.shard_params and config.offload_params == "nvme":
            out.nvme += int(f * shard * p)
        if f and config.delayed_step:
            out.host += int(4 * shard * f)  # the second host gradient arena (the next window lands there)
        if f and accumulate > 1 and config.offload_accumulation == "host":
            out.host += 2 * 4 * min(largest_unit or n // 24, int(shard))  # two pinned staging slots
    out.gpu_total = out.gpu_state + activations + CUDA_CONTEXT_BYTES
    out.fits = (out.gpu_total <= out.gpu_total_cap and out.host * hw.gpus_per_node <= hw.host_bytes * HEADROOM
                and out.nvme * hw.gpus_per_node <= hw.nvme_bytes * HEADROOM + (0 if out.nvme else 1))
    _times(out, n, hw, tokens_per_step, accumulate)
    return out


def _accum_bytes(config: ZeroConfig, compute_bytes: int) -> int:
    name = config.grad_accum_dtype
    return compute_bytes if name is None else (4 if name in ("fp32", "float32") else 2)


def placement_name(config: ZeroConfig) -> str:
    name = f"zero{config.stage}"
    if config.offloads:
        where = config.offload_optimizer + ("+params " + config.offload_params if config.offload_params != "none" else "")
        share = "" if config.offload_fraction == 1.0 else f" {config.offload_fraction:.0%}"
        name += f" offload {where}{share}"
        if config.offload_accumulation == "host":
            name += ", host acc."
    return name


def _times(out: Placement, n: int, hw: Hardware, tokens: int, accumulate: int) -> None:
    """Seconds per step (``tokens``: one micro-batch of every rank) of each resource; the largest is the
    bottleneck."""
    w, config = hw.world, out.config
    t = {"GPU compute": 6.0 * n * tokens * accumulate / w / (hw.gpu_tflops * 1e12 * 0.6) if tokens else 0.0}
    if config is not None and config.offloads:
        f, shard = config.offload_fraction, n / w
        host_adds = accumulate - 1 if config.offload_accumulation == "host" else 0
        moved = f * shard * 4 * (1 + host_adds) + f * shard * 4  # gradients down (each micro-batch), master up
        if config.shard_params and config.offload_params != "none":
            moved += 2 * f * shard * 4 * accumulate  # forward and backward gathers copy from the host
        t["PCIe"] = moved / (hw.pcie_gbps * 1e9)
        # an add streams 12 bytes an element where AdamW streams 28: about 2.3x the step's rate
        t["CPU step"] = f * shard * (1 + host_adds * 12 / 28) / (hw.cpu_step_params_per_s / hw.gpus_per_node)
        if config.offload_optimizer == "nvme":
            t["NVMe"] = 2 * out.nvme * hw.gpus_per_node / (hw.nvme_gbps * 1e9)
    out.seconds = t
    out.bottleneck = max(t, key=t.get) if any(t.values()) else "GPU compute"


CANDIDATES = (
    None,
    ZeroConfig(stage=1), ZeroConfig(stage=2), ZeroConfig(stage=3),
    ZeroConfig(stage=2, offload_optimizer="cpu"),
    ZeroConfig(stage=3, offload_optimizer="cpu", offload_params="cpu"),
    ZeroConfig(stage=3, offload_optimizer="nvme", offload_params="nvme"),
)


# (stage, offload_params) of the partial placements searched, in order of traffic: zero2; zero3; zero3 with the
# offloaded units gathered from the host (more PCIe traffic, no 16-bit copy of them on the GPU)
PARTIALS = ((2, "none"), (3, "none"), (3, "cpu"))


def plan(num_params: int, hw: Hardware, **kwargs: object) -> list[Placement]:
    """Every candidate, plus the recommended partial placement, in the order of least traffic first. With
    ``accumulate`` > 1 each offload row also comes with host accumulation (no device accumulator)."""
    rows = [estimate(num_params, config, hw, **kwargs)
            for candidate in CANDIDATES for config in ([None] if candidate is None else _with_accumulation(candidate, kwargs))]
    partials = [row for row in (recommend_partial(num_params, hw, stage=s, params=where, **kwargs)
                                for s, where in PARTIALS) if row]
    if partials:
        best = partials[0]  # stage 2 when it fits: no gathers, the least traffic
        for row in partials:
            row.name += " (recommended partial)" if row is best else " (partial)"
        rows[4:4] = partials
    return rows


def _with_accumulation(config: ZeroConfig, kwargs: dict) -> list[ZeroConfig]:
    """``config``, then (offloading with accumulation) the same with host accumulation: more PCIe traffic,
    no device memory for the offloaded gradients."""
    if config.offloads and int(kwargs.get("accumulate", 1)) > 1:
        return [config, config.replace(offload_accumulation="host")]
    return [config]


def _gpu_fits(row: Placement) -> bool:
    return row.gpu_total <= row.gpu_total_cap


def recommend_partial(num_params: int, hw: Hardware, stage: int = 2, params: str = "none",
                      **kwargs: object) -> Optional[Placement]:
    """``stage`` with the smallest offload fraction (to 1%) that fits, when zero2 without offload does not;
    the device accumulator is preferred to host accumulation at the same fraction. (Stage 3 keeps no 16-bit
    copy of the units it does not offload: the gathers cast their fp32 masters, so it fits more; with
    ``params="cpu"`` the offloaded units keep none on the GPU either: their gathers copy the fp32 host master,
    which is what fits the largest models on one GPU.)

    GPU memory falls and host memory grows with the fraction, so the smallest fraction whose GPU side fits
    is found by bisection, and the placement fits at all only if its host side fits there."""
    if estimate(num_params, ZeroConfig(stage=2), hw, **kwargs).fits:
        return None
    best: Optional[Placement] = None
    base = ZeroConfig(stage=stage, offload_optimizer="cpu", offload_fraction=0.99, offload_params=params)
    for variant in _with_accumulation(base, kwargs):
        def row_at(percent: int, variant: ZeroConfig = variant) -> Placement:
            return estimate(num_params, variant.replace(offload_fraction=percent / 100), hw, **kwargs)

        if not _gpu_fits(row_at(99)):
            continue
        lo, hi = 0, 99  # GPU side: lo does not fit (0% is zero2/zero3 itself), hi does
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if _gpu_fits(row_at(mid)) else (mid, hi)
        row = row_at(hi)
        if row.fits and (best is None or row.config.offload_fraction < best.config.offload_fraction):
            best = row
    return best


def choose(num_params: int, hw: Hardware, base: ZeroConfig, **kwargs: object) -> Placement:
    """The first placement that fits, in the order of least traffic: stages without offload, then zero2 and
    zero3 with the smallest partial offload that fits, the same for zero3 with the offloaded units gathered from
    the host, full CPU offload, stage 3 with parameters on the CPU, NVMe (each
    offload with a device accumulator before host accumulation). On one GPU, when every placement that fits
    offloads, the one with the least predicted step time among them (the CPU step and PCIe dominate there)."""
    options = [ZeroConfig(stage=s) for s in (2, 3)]
    options += [row.config for row in (recommend_partial(num_params, hw, stage=s, params=where, **kwargs)
                                       for s, where in PARTIALS) if row]
    options += [ZeroConfig(stage=2, offload_optimizer="cpu"),
                ZeroConfig(stage=3, offload_optimizer="cpu", offload_params="cpu")]
    if hw.nvme_bytes:
        options.append(ZeroConfig(stage=3, offload_optimizer="nvme", offload_params="nvme"))
    keep = {k: v for k, v in base.to_dict().items()
            if k not in ("stage", "offload_optimizer", "offload_params", "offload_fraction", "offload_accumulation",
                         "auto_placement")}
    fitting = [row for option in options if _allowed(option, keep)
               for config in _with_accumulation(option.replace(**keep), kwargs)
               for row in [estimate(num_params, config, hw, **kwargs)] if row.fits]
    if fitting and fitting[0].config.offloads and hw.world == 1:
        # offloading anyway on one GPU, where stage 3's gathers are local copies: the least predicted step time
        fitting = sorted(fitting, key=lambda r: _step_seconds(r))  # stable: ties keep the order of traffic
    if fitting:
        row = fitting[0]
        row.runner_up = next((r for r in fitting[1:] if r.name != row.name), None)
        row.why = (f"{_figures(row, hw)}; the first that fits in order of least traffic"
                   + (", then of least predicted step time" if row.config.offloads and hw.world == 1 else "")
                   + (f" (runner-up {_figures(row.runner_up, hw)})" if row.runner_up else ""))
        return row
    raise ValueError(
        f"No placement fits {num_params / 1e9:.2f}B parameters on {hw.world} {hw.device_name}(s) of {hw.gpu_bytes / GiB:.0f} GiB "
        f"with {hw.host_bytes / GiB:.0f} GiB host memory and {hw.nvme_bytes / GiB:.0f} GiB NVMe per node: add GPUs "
        f"or nodes, give an nvme_path with room, or use activation checkpointing / a smaller micro-batch.")


def _step_seconds(row: Placement) -> float:
    return max(row.seconds.values()) if row.seconds else 0.0


def _allowed(option: ZeroConfig, keep: dict) -> bool:
    """Whether the user's other fields allow this placement (delayed_step keeps the parameters on the device)."""
    from .config import ZeroConfigError

    try:
        option.replace(**keep)
    except ZeroConfigError:
        return False
    return True


def _figures(row: Placement, hw: Hardware) -> str:
    step = _step_seconds(row)
    return (f"{row.name}: {row.gpu_total / GiB:.1f} GiB of {hw.gpu_bytes / GiB:.0f} GiB {hw.device_name}, {row.host / GiB:.1f} "
            f"GiB host per rank" + (f", {step:.2f} s a step ({row.bottleneck})" if step else ""))


ACTIVATION_SHARE = 0.25  # zero_auto plans before any step ran: this share of GPU memory stays free for activations
ACTIVATION_FLOOR = 0.08  # when nothing fits with that share: a provisional plan the first step then checks (replan.py)


def gpu_budget(device: Any) -> int:
    """Bytes this process may allocate on its GPU: the device's memory times the per-process memory fraction
    (``torch.cuda.set_per_process_memory_fraction``), and no more than is free now (other processes) plus
    what this process already holds."""
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
    free, _ = torch.cuda.mem_get_info(device)
    return int(min(total * fraction, free + torch.cuda.memory_reserved(device)))


def hardware_here(device: object, gpus_per_node: int, nodes: int, config: ZeroConfig,
                  activation_share: float = ACTIVATION_SHARE, host_returning: int = 0) -> Hardware:
    """The node this process runs on: the GPU memory this process may use less ``activation_share`` of it,
    the host memory the node (its cgroup) can still give (see host_memory; ``host_returning``: bytes each rank
    holds now and frees before the placement allocates) and the NVMe directory's free space."""
    import os
    import shutil

    from .host_memory import read_host_budget

    gpu_side = getattr(device, "type", "") == "cuda"
    gpu = gpu_budget(device) if gpu_side else 0
    budget = read_host_budget(gpus_per_node, returning=host_returning)
    host = max(0, budget.node_free - budget.headroom)  # the last bytes stay with the system (host_memory)
    path = config.nvme_path or os.environ.get("LIGHTNING_ZERO_NVME_PATH")
    nvme = shutil.disk_usage(path).free if path and os.path.isdir(path) else 0
    if not gpu:  # CPU training: "device" memory is the host's, shared by the ranks of the node
        gpu = host // max(gpus_per_node, 1)
    return Hardware(gpus_per_node=gpus_per_node, nodes=nodes, gpu_bytes=int(gpu * (1 - activation_share)),
                    host_bytes=host, nvme_bytes=nvme, device_name="GPU" if gpu_side else "CPU")


def host_bytes_per_rank(num_params: int, config: ZeroConfig, world: int, compute_bytes: int, accumulate: int = 1,
                        largest_unit: int = 0) -> int:
    """The host memory one rank of ``world`` allocates for ``config`` (what the engine checks before allocating)."""
    return estimate(num_params, config, Hardware(gpus_per_node=1, nodes=world), compute_bytes=compute_bytes,
                    accumulate=accumulate, largest_unit=largest_unit).host


def plan_for_run(module: Any, device: Any, gpus_per_node: int, nodes: int, config: ZeroConfig, compute_dtype: Any,
                 accumulate: int, activations: int = 0, measured: Optional[int] = None, host_returning: int = 0) -> list:
    """``[config as a dict, why]``: what ``zero_auto`` chooses for this module on this machine.

    Before any step ran (``measured`` None) a share of the GPU stays free for activations (``activations``:
    room known to be needed beyond it, after the first step ran out of memory); when nothing fits so, a
    smaller share on a GPU, the first step's measurement then decides (replan.py). With ``measured`` (the
    activation bytes the first step used, margin included) nothing else is kept back. ``host_returning``: host
    bytes each rank holds now and frees before the placement allocates (see host_memory.read_host_budget)."""
    import torch

    numel = sum(p.numel() for p in module.parameters())
    kwargs = dict(compute_bytes=2 if compute_dtype != torch.float32 else 4, accumulate=accumulate)
    here = functools.partial(hardware_here, device, gpus_per_node, nodes, config, host_returning=host_returning)
    where = "GPU" if getattr(device, "type", "") == "cuda" else "rank's share of the host"
    if measured is not None:
        choice = choose(numel, here(0.0), config, activations=measured, **kwargs)
        return [choice.config.to_dict(), f"{choice.why}; activations as measured in the first step: "
                                         f"{measured / GiB:.2f} GiB with the margin"]
    try:
        choice = choose(numel, here(ACTIVATION_SHARE), config, activations=activations, **kwargs)
        note = f"{ACTIVATION_SHARE:.0%} of the {where} kept for activations until the first step measures them"
    except ValueError:
        if getattr(device, "type", "") != "cuda":
            raise
        choice = choose(numel, here(ACTIVATION_FLOOR), config, activations=activations, **kwargs)
        note = (f"provisional: nothing fits with {ACTIVATION_SHARE:.0%} of the GPU kept for activations, so "
                f"{ACTIVATION_FLOOR:.0%} until the first step measures them")
    return [choice.config.to_dict(), f"{choice.why}; {note}"]


def fits_measured(module: Any, device: Any, gpus_per_node: int, nodes: int, config: ZeroConfig, compute_dtype: Any,
                  accumulate: int, measured: int, host_returning: int = 0) -> bool:
    """Whether ``config`` (the placement running) fits this machine with the ``measured`` activation bytes (margin
    included) and the optimizer state the first step has not created yet (``host_returning``: the host bytes
    the running placement holds already, part of its estimate)."""
    import torch

    numel = sum(p.numel() for p in module.parameters())
    row = estimate(numel, config, hardware_here(device, gpus_per_node, nodes, config, 0.0, host_returning),
                   compute_bytes=2 if compute_dtype != torch.float32 else 4, accumulate=accumulate,
                   activations=measured)
    return row.fits


def offloaded_share(config: ZeroConfig) -> float:
    """The share of the model states a placement keeps off the GPU (for comparing two placements)."""
    return config.offload_fraction if config.offloads else 0.0


def lighter(new: ZeroConfig, old: ZeroConfig, min_gain: float = 0.05) -> bool:
    """Whether ``new`` moves clearly less over PCIe than ``old`` (worth rebuilding the engine for): at least
    ``min_gain`` less of the states offloaded, or the same offload at a lower stage (no gathers)."""
    a, b = offloaded_share(new), offloaded_share(old)
    if a <= b - min_gain or (b > 0 and a == 0):
        return True
    return a == b and new.stage < old.stage
