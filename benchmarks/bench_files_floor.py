#!/usr/bin/env python
"""The floor under a load that touches every file of a checkpoint: an open, an ``fstat`` and one
8-byte ``pread`` of each data file, cold (each file dropped from the page cache with
``posix_fadvise(DONTNEED)`` first) and then warm.

One tensor of a checkpoint saved by N ranks lives in N files, so no reader of that layout can
load it faster than this. Compare with ``bench_scale.py``'s "one tensor" column::

    python benchmarks/bench_files_floor.py CHECKPOINT_DIR [--threads 1,8,32]
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _touch(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return len(os.pread(fd, 8, os.fstat(fd).st_size // 2))
    finally:
        os.close(fd)


def timed(paths: list[str], threads: int) -> float:
    """Seconds to touch every file, with ``threads`` threads (1: in this one)."""
    t = time.perf_counter()
    if threads <= 1:
        for p in paths:
            _touch(p)
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(_touch, paths, chunksize=256))
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", help="a checkpoint directory (its *.safetensors files are touched)")
    ap.add_argument("--threads", default="1,8,32", help="comma-separated thread counts")
    a = ap.parse_args(argv)
    paths = sorted(os.path.join(a.directory, n) for n in os.listdir(a.directory) if n.endswith(".safetensors"))
    if not paths:
        ap.error(f"{a.directory!r} holds no .safetensors files")
    for threads in (int(x) for x in a.threads.split(",")):
        for p in paths:
            _drop(p)
        cold = timed(paths, threads)
        warm = timed(paths, threads)
        print(f"{len(paths)} files, {threads} thread(s): cold {cold:.2f} s, warm {warm:.2f} s "
              f"(open + fstat + one 8-byte pread each)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
