"""``python -m lightning_zero.consolidate CKPT_DIR [OUT.ckpt] [--weights-only OUT.pt]``

Turns a sharded checkpoint directory into one ordinary Lightning checkpoint (resumable by any
strategy, DDP included) and/or a plain ``state_dict`` file for ``module.load_state_dict``, with
no process group and memory bounded by the largest tensor.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

from .checkpoint.export import write_checkpoint, write_weights
from .checkpoint.files import CheckpointPathError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_zero.consolidate", description=__doc__.split("\n\n")[1])
    parser.add_argument("checkpoint", help="a sharded checkpoint directory (e.g. checkpoints/last.ckpt)")
    parser.add_argument("out", nargs="?", help="write one Lightning checkpoint file here")
    parser.add_argument("--weights-only", metavar="OUT.pt", help="write the model's plain state_dict here")
    args = parser.parse_args(argv)
    if args.out is None and args.weights_only is None:
        parser.error("give OUT.ckpt, --weights-only OUT.pt, or both")
    try:
        for writer, out in ((write_checkpoint, args.out), (write_weights, args.weights_only)):
            if out is not None:
                start = time.perf_counter()
                written = writer(args.checkpoint, out)
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
                print(f"wrote {out}: {written / 2**20:.1f} MiB of tensors in {time.perf_counter() - start:.1f} s "
                      f"(peak RSS {peak:.2f} GiB)")
    except (CheckpointPathError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
