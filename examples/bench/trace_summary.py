"""A text timeline of one profiled training step from a chrome trace (``gpt_bench.py --profile PATH``).

Rows: the GPU's kernels, its copies each way, the main thread's forward / backward / clipping / optimizer step
(Lightning's profiler ranges) and the engine's own ranges on every thread (the host step, host gradient adds,
publishing). Each row prints busy time, first start and last end in ms from the step's start, and a bar of
``--width`` columns over the step ('#' busy for most of the column, '+' partly, '.' idle).

    python examples/bench/trace_summary.py trace.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict

ROWS = (  # label, which events (category, name pattern); main: only the thread that runs the training loop
    ("GPU kernels", "kernel", r".*", False),
    ("copy GPU->host", "gpu_memcpy", r".*DtoH|.*Device -> Pinned|.*Device -> Pageable", False),
    ("copy host->GPU", "gpu_memcpy", r".*HtoD|.*Pinned -> Device|.*Pageable -> Device", False),
    ("forward (training_step)", "user_annotation", r"\[pl\]\[profile\]\[Strategy\]\w+\.training_step", True),
    ("backward", "user_annotation", r"\[pl\]\[profile\]\[Strategy\]\w+\.backward", True),
    ("clip gradients", "user_annotation", r".*configure_gradient_clipping", True),
    ("optimizer.step", "user_annotation", r"Optimizer\.step#.*", True),
    ("host step (worker, in backward)", "user_annotation", r"zero/host_step_in_backward.*", False),
    ("host step (after backward)", "user_annotation", r"zero/host_step\[.*", False),
    ("delayed host step", "user_annotation", r"zero/delayed.*", False),
    ("host gradient adds", "user_annotation", r"zero/host_accumulate", False),
    ("publish to GPU", "user_annotation", r"zero/publish|zero/republish", False),
)


def load(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def bar(intervals: list[tuple[float, float]], start: float, end: float, width: int) -> str:
    step = (end - start) / width
    cells = []
    for i in range(width):
        lo, hi = start + i * step, start + (i + 1) * step
        covered = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)
        cells.append("#" if covered >= 0.5 * step else ("+" if covered > 0 else "."))
    return "".join(cells)


def summarize(events: list[dict], width: int = 80) -> str:
    spans = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    if not spans:
        raise SystemExit("no ProfilerStep range in the trace (was a step recorded?)")
    main_tid = spans[0]["tid"]
    forwards = sorted(e["ts"] for e in events if e.get("ph") == "X" and e.get("tid") == main_tid
                      and re.fullmatch(ROWS[3][2], str(e.get("name", ""))))
    if len(forwards) >= 2:  # from a step's first forward to the next step's (the profiler records one more)
        start, end = forwards[0], forwards[-1]
    else:
        start, end = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
    rows = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        a, b = e["ts"], e["ts"] + e["dur"]
        if b < start or a > end:
            continue
        for label, cat, pattern, main_only in ROWS:
            if e.get("cat") != cat or (main_only and e.get("tid") != main_tid):
                continue
            if re.fullmatch(pattern, str(e.get("name", ""))):
                rows[label].append((max(a, start), min(b, end)))
    total_ms = (end - start) / 1e3
    lines = [f"one step: {total_ms:.1f} ms ({max(1, len(forwards) - 1)} micro-batch(es)); columns of {total_ms / width:.1f} ms",
             f"{'':32} {'busy ms':>8} {'from':>7} {'to':>7}  timeline"]
    for label, *_ in ROWS:
        merged = union(rows.get(label, []))
        if not merged:
            continue
        busy = sum(b - a for a, b in merged) / 1e3
        lines.append(f"{label:32} {busy:8.1f} {(merged[0][0] - start) / 1e3:7.1f} {(merged[-1][1] - start) / 1e3:7.1f}  "
                     f"{bar(merged, start, end, width)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--width", type=int, default=80)
    a = ap.parse_args(argv)
    print(summarize(load(a.trace), a.width))
    return 0


if __name__ == "__main__":
    sys.exit(main())
