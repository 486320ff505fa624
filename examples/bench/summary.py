#!/usr/bin/env python3
"""One line per record of ``$OUT/results.jsonl`` (or the files given): what the device-call scripts print at
their end, so that the output tail of a call already holds the figures."""

from __future__ import annotations

import json
import os
import sys

from bench_out import out_dir

FIELDS = (("status", "status"), ("params_b", "params B"), ("tokens_per_s", "tok/s"), ("mfu", "mfu"),
          ("step_s_median", "median step s"), ("gpu_peak_alloc_gib", "alloc"), ("plan_gpu_total_gib", "planned"),
          ("gpu_peak_reserved_gib", "reserved"), ("host_peak_rss_gib", "host rss"), ("plan_host_gib", "planned"),
          ("offload_seconds", "offload s"))


def line(record: dict) -> str:
    parts = [f"{record.get('tag') or record.get('strategy')}:"]
    parts += [f"{label} {record[key]}" for key, label in FIELDS if record.get(key) is not None]
    if record.get("error"):
        parts.append(str(record["error"])[:300])
    return " ".join(parts)


def main(paths: list[str]) -> int:
    for path in paths or [os.path.join(out_dir(), "results.jsonl")]:
        if os.path.exists(path):
            for text in open(path):
                if text.strip():
                    print(line(json.loads(text)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
