"""Two runs' loss curves side by side, from the CSV logs the app writes (``logs/version_*/metrics.csv``): validation
loss at each validation, training loss averaged over each interval, and the difference at the end.

    python examples/bench/loss_curves.py exact=outputs/a/logs/version_0/metrics.csv delayed=outputs/b/logs/version_0/metrics.csv
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict


def read(path: str) -> tuple[dict[int, float], dict[int, float]]:
    """(step -> validation loss, step -> training loss) of one run."""
    val, train = {}, {}
    with open(path) as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            if row.get("val/loss"):
                val[step] = float(row["val/loss"])
            if row.get("train/loss"):
                train[step] = float(row["train/loss"])
    return val, train


def interval_means(train: dict[int, float], edges: list[int]) -> list[float]:
    sums, counts = defaultdict(float), defaultdict(int)
    for step, loss in train.items():
        for i, edge in enumerate(edges):
            if step <= edge:
                sums[i] += loss
                counts[i] += 1
                break
    return [sums[i] / counts[i] if counts[i] else float("nan") for i in range(len(edges))]


def main(args: list[str]) -> None:
    runs = dict(arg.split("=", 1) for arg in args)
    names = list(runs)
    curves = {name: read(path) for name, path in runs.items()}
    edges = sorted(set.intersection(*(set(val) for val, _ in curves.values())))
    means = {name: interval_means(train, edges) for name, (_, train) in curves.items()}
    print("| step | " + " | ".join(f"{n} val loss | {n} train loss (interval mean)" for n in names) + " |")
    print("|---" * (1 + 2 * len(names)) + "|")
    for i, step in enumerate(edges):
        cells = [f"{curves[n][0][step]:.4f} | {means[n][i]:.4f}" for n in names]
        print(f"| {step + 1} | " + " | ".join(cells) + " |")
    if len(names) == 2 and edges:
        a, b = (curves[n][0][edges[-1]] for n in names)
        print(f"\nfinal validation loss: {names[0]} {a:.4f}, {names[1]} {b:.4f}, "
              f"difference {b - a:+.4f} ({(b - a) / a:+.2%})")


if __name__ == "__main__":
    main(sys.argv[1:])
