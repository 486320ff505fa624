"""Where the benchmark scripts write their records."""

from __future__ import annotations

import os


def out_dir() -> str:
    """$OUT (a device call's output folder), else examples/bench/out (ignored by git)."""
    out = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(out, exist_ok=True)
    return out
