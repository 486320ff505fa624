"""``python -m lightning_zero.estimate``: what fits where, before renting the machine.

    python -m lightning_zero.estimate --params 13e9 --gpu-mem 139 --host-mem 125 --nvme 60
    python -m lightning_zero.estimate model=gpt_small --gpus-per-node 8 --nodes 2 --batch 16 --seq 1024
    python -m lightning_zero.estimate model=gpt_13b --batch 4 --accumulate 8 --activations 12

Prints one row per configuration (DDP, zero1/2/3, each offload, the recommended partial placement):
per-rank GPU memory for model states and in total, host memory, NVMe, the memory left for
activations and the expected bottleneck. With ``model=NAME`` (a Hydra ``conf/model`` entry) the
parameters are counted on the meta device and, on a machine with a GPU, the activations of one
micro-batch are measured in a probe step (depth 2 and 3 on the GPU, extrapolated; see
lightning_zero.probe; ``--checkpointing Block`` as the strategy would); without a GPU they are
estimated as 34·seq·batch·d_model bytes a layer (16-bit, fused attention, no recomputation).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from .planner import GiB, Hardware, Placement, plan


def build_model(name: str, overrides: list[str], device: str = "meta", n_layer: Optional[int] = None):
    """A ``conf/model`` entry's LightningModule, built on ``device`` (``n_layer``: another depth)."""
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from .train import CONF_DIR, register_schema

    register_schema()
    depth = [] if n_layer is None else [f"model.n_layer={n_layer}"]
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[f"model={name}", *overrides, *depth])
    with torch.device(device):
        module = instantiate(cfg.model, vocab_size=int(cfg.model.get("vocab_size", 0) or 32000))
        if getattr(module, "model", None) is None and hasattr(module, "configure_model"):
            module.configure_model()
    return module, cfg.model


def count_model(name: str, overrides: list[str]) -> tuple[int, dict]:
    """Parameters of a ``conf/model`` entry (built on the meta device) and its shape fields."""
    module, cfg = build_model(name, overrides)
    numel = sum(p.numel() for p in module.parameters())
    return numel, {k: cfg[k] for k in ("n_layer", "d_model", "vocab_size", "seq_len") if k in cfg}


def probe_model(name: str, overrides: list[str], shape: dict, batch: int, seq: int, precision: str,
                checkpointing: tuple[str, ...]):
    """Activations of ``model=NAME`` measured on this machine's GPU (see lightning_zero.probe)."""
    import torch

    from .probe import next_token_step, probe_activations

    vocab = int(shape.get("vocab_size") or 32000)
    step = next_token_step(torch.randint(0, vocab, (batch, seq + 1), device="cuda"))
    dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(precision.split("-")[0], torch.float32)
    return probe_activations(lambda depth: build_model(name, overrides, "cpu", depth)[0], int(shape["n_layer"]),
                             step, torch.device("cuda", torch.cuda.current_device()), dtype, checkpointing)


def table(rows: list[Placement], hw: Hardware) -> str:
    head = (f"{'configuration':<58}{'GPU states':>11}{'GPU total':>11}{'act. free':>11}{'host/rank':>11}"
            f"{'NVMe/rank':>11}  fits  bottleneck")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.name:<58}{r.gpu_state / GiB:>10.1f}G{r.gpu_total / GiB:>10.1f}G"
                     f"{max(r.free_for_activations, 0) / GiB:>10.1f}G{r.host / GiB:>10.1f}G{r.nvme / GiB:>10.1f}G"
                     f"  {'yes ' if r.fits else 'no  '}  {r.bottleneck}")
    lines.append(f"{hw.world} GPU(s) of {hw.gpu_bytes / GiB:.0f} GiB, {hw.host_bytes / GiB:.0f} GiB host and "
                 f"{hw.nvme_bytes / GiB:.0f} GiB NVMe per node ({hw.gpus_per_node} GPU(s) each). GPU total = states + "
                 f"activations + CUDA context; 'act. free' = what is left for activations.")
    return "\n".join(lines)


# Lightning's precision names and their common spellings -> (the name shown, bytes a parameter computes in)
PRECISIONS = {"32-true": ("32-true", 4), "32": ("32-true", 4), "fp32": ("32-true", 4), "float32": ("32-true", 4),
              "bf16-mixed": ("bf16-mixed", 2), "bf16": ("bf16-mixed", 2), "16-mixed": ("16-mixed", 2),
              "16": ("16-mixed", 2), "fp16": ("16-mixed", 2)}


class _Parser(argparse.ArgumentParser):
    """argparse, but every error is one line (no usage block): ``PROG: error: ...``, exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _check_ranges(ap: _Parser, args: argparse.Namespace) -> None:
    """Sizes and counts must be finite and positive (NVMe and activations may be 0)."""
    import math

    rules = [("params", args.params, False), ("gpu-mem", args.gpu_mem, False), ("host-mem", args.host_mem, False),
             ("nvme", args.nvme, True), ("activations", args.activations, True), ("gpus-per-node", args.gpus_per_node, False),
             ("nodes", args.nodes, False), ("batch", args.batch, False), ("seq", args.seq, False),
             ("accumulate", args.accumulate, False)]
    for name, value, zero_ok in rules:
        if value is None:
            continue
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            ap.error(f"--{name} {value:g}: give a finite number {'>= 0' if zero_ok else '> 0'}")
    if args.params is not None and args.params < 1:
        ap.error(f"--params {args.params:g}: a model has at least one parameter (e.g. --params 1.3e9)")


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    model = next((a.split("=", 1)[1] for a in argv if a.startswith("model=")), None)
    overrides = [a for a in argv if "=" in a and not a.startswith("-") and not a.startswith("model=")]
    flags = [a for a in argv if a.startswith("-") or "=" not in a]
    ap = _Parser(prog="python -m lightning_zero.estimate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, help="parameter count (e.g. 1.3e9); or give model=NAME")
    ap.add_argument("--gpus-per-node", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpu-mem", type=float, default=139.0, help="GiB per GPU")
    ap.add_argument("--host-mem", type=float, default=125.0, help="GiB per node")
    ap.add_argument("--nvme", type=float, default=0.0, help="GiB of NVMe space per node")
    ap.add_argument("--precision", default="bf16-mixed",
                    help="bf16-mixed, 16-mixed or 32-true (also bf16, fp16, 16, fp32, 32)")
    ap.add_argument("--batch", type=int, default=8, help="micro-batch per GPU (activation estimate)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--accumulate", type=int, default=1,
                    help="micro-batches per optimizer step (offload: also rows with host accumulation)")
    ap.add_argument("--activations", type=float, help="GiB of activations per micro-batch (overrides the estimate)")
    ap.add_argument("--checkpointing", nargs="*", default=[], metavar="CLASS",
                    help="model=NAME: module classes under activation checkpointing in the probe (e.g. Block)")
    ap.add_argument("--no-probe", action="store_true",
                    help="model=NAME on a GPU machine: skip the probe step, use the formula")
    args = ap.parse_args(flags)
    if (args.params is None) == (model is None):
        ap.error("give exactly one of --params N or model=NAME")
    if args.precision not in PRECISIONS:
        ap.error(f"--precision {args.precision!r} is not one of {', '.join(PRECISIONS)}")
    args.precision, p = PRECISIONS[args.precision]
    _check_ranges(ap, args)
    shape: dict = {}
    if model is not None:
        try:
            numel, shape = count_model(model, overrides)
        except Exception as err:  # noqa: BLE001 - Hydra's composition errors span many lines: one line here
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            ap.error(f"model={model} {' '.join(overrides)}: {first} (models: conf/model/*.yaml)")
    else:
        numel = int(args.params)
    how = "given"
    if args.activations is not None:
        act = int(args.activations * GiB)
    elif shape and _has_cuda() and not args.no_probe:
        if args.seq > int(shape.get("seq_len") or args.seq):
            ap.error(f"--seq {args.seq} is longer than the model's seq_len={shape['seq_len']}: pass "
                     f"model.seq_len={args.seq} too")
        probe = probe_model(model, overrides, shape, args.batch, args.seq, args.precision, tuple(args.checkpointing))
        act, how = probe.total, probe.describe()
    elif shape:
        layer = 34 * args.seq * args.batch * shape["d_model"] * p // 2  # what one layer keeps for backward
        if args.checkpointing:  # each layer keeps its input; one layer's recomputation is alive at a time
            act = shape["n_layer"] * args.seq * args.batch * shape["d_model"] * p + layer
            how = "estimated as one layer input a layer + one recomputed layer (no GPU here for a probe step)"
        else:
            act = shape["n_layer"] * layer
            how = "estimated as 34·seq·batch·d_model bytes a layer (no GPU here for a probe step)"
    else:
        act = 0
    hw = Hardware(gpus_per_node=args.gpus_per_node, nodes=args.nodes, gpu_bytes=int(args.gpu_mem * GiB),
                  host_bytes=int(args.host_mem * GiB), nvme_bytes=int(args.nvme * GiB))
    rows = plan(numel, hw, compute_bytes=p, activations=act, tokens_per_step=args.batch * args.seq * hw.world,
                accumulate=args.accumulate)
    print(f"{numel:,} parameters ({numel / 1e9:.2f}B), {args.precision}, activations {act / GiB:.1f} GiB per GPU, "
          f"{args.accumulate} micro-batch(es) a step")
    if how != "given" and shape:
        print(how)
    print(table(rows, hw))
    return 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    raise SystemExit(main())
