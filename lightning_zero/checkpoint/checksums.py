"""A CRC-32 of every file of a sharded checkpoint, written with it and checked when it is read.

[Note: why checksums]
Neither DCP nor DeepSpeed notices a shard whose bytes changed without changing its size (a bad copy, a
flipped disk block): the values load as they are and training continues with NaN weights. Every rank
checksums the files it wrote right after writing them (still in the page cache; a thread per file; zlib
runs at ~2 GB/s a thread, beside a write of the same bytes); rank 0 adds ``meta.pt`` and ``.metadata``
and writes ``checksums.json`` before the directory is committed. Readers verify before they parse:
every rank checks the small files and its share of the shards (all shards in one process, e.g. the
consolidate tool), and the ranks agree on the verdict, so a mismatch is one error naming the file on
every rank. Checkpoints written before checksums existed load as before.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

from .files import CheckpointPathError

__all__ = ["CHECKSUM_FILE", "file_checksums", "write", "verify"]

CHECKSUM_FILE = "checksums.json"
_CHUNK = 16 << 20
_THREADS = 4


def _crc(path: Path) -> dict[str, Any]:
    crc, size, buf = 0, 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"crc32": f"{crc:08x}", "bytes": size}


def file_checksums(paths: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """name -> {"crc32", "bytes"} of each file, several files at a time."""
    paths = list(paths)
    with ThreadPoolExecutor(max_workers=max(1, min(_THREADS, len(paths)))) as pool:
        return {p.name: r for p, r in zip(paths, pool.map(_crc, paths))}


def write(directory: Path, entries: dict[str, dict[str, Any]]) -> None:
    (directory / CHECKSUM_FILE).write_text(json.dumps(dict(sorted(entries.items())), indent=0))


def _expected(directory: Path) -> Optional[dict[str, dict[str, Any]]]:
    file = directory / CHECKSUM_FILE
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        raise CheckpointPathError(f"Checkpoint {directory}: {CHECKSUM_FILE} is damaged; the checkpoint cannot be "
                                  f"verified. Copy the whole directory again.") from None


def _problem(directory: Path, name: str, want: dict[str, Any]) -> Optional[str]:
    file = directory / name
    if not file.is_file():
        return f"Checkpoint {directory} is incomplete: {name} is missing"
    have = _crc(file)
    if have["bytes"] < want["bytes"]:
        return f"Checkpoint {directory} is incomplete: {name} is truncated ({have['bytes']} of {want['bytes']} bytes)"
    if have["bytes"] != want["bytes"]:
        return f"Checkpoint {directory} is damaged: {name} has {have['bytes']} bytes, {want['bytes']} were written"
    if have["crc32"] != want["crc32"]:
        return (f"Checkpoint {directory} is damaged: {name} does not match the checksum written with it "
                f"(crc32 {have['crc32']}, written {want['crc32']})")
    return None


def verify(directory: Path, share: tuple[int, int] = (0, 1), small_only: bool = False) -> Optional[str]:
    """The first problem found (None: all good, or no checksums to check): the small files always, and the
    shards whose position modulo ``share[1]`` is ``share[0]`` (``small_only``: none of them)."""
    expected = _expected(directory)
    if expected is None:
        return None
    small = [n for n in expected if not n.endswith(".distcp")]
    shards = sorted(n for n in expected if n.endswith(".distcp"))
    mine = [] if small_only else [n for i, n in enumerate(shards) if i % share[1] == share[0]]
    with ThreadPoolExecutor(max_workers=_THREADS) as pool:
        problems = list(pool.map(lambda n: _problem(directory, n, expected[n]), small + mine))
    return next((p for p in problems if p is not None), None)


def raise_problem(problem: Optional[str]) -> None:
    if problem is not None:
        raise CheckpointPathError(f"{problem}. Resume from an earlier checkpoint or copy the whole directory again.")
