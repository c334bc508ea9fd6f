#!/usr/bin/env python
"""How long ``CheckpointManager(root)`` takes to open a directory of many committed steps.

Builds ``--steps`` incremental steps (each changes one of ``--tensors`` tensors, so every step
names earlier steps' files), then opens the directory in a fresh process ``--reps`` times and
reports the median time from the constructor call to ``latest_step`` (Python's start-up and
imports excluded), checked against the 1 s target. Then the answer is checked to stay right
when the newest step is deleted, and when a step's ``.metadata`` is corrupted (it is reported
as unreadable and kept, never counted as latest).

Usage::

    python benchmarks/bench_manager_open.py                  # 1000 steps
    python benchmarks/bench_manager_open.py --steps 100      # quick
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_S = 1.0

_OPEN = """
import sys, time, warnings
warnings.simplefilter("ignore")
from hyper_parallel.core.distributed_checkpoint import CheckpointManager
t = time.perf_counter()
m = CheckpointManager(sys.argv[1], incremental=True)
latest = m.latest_step()
print(time.perf_counter() - t, latest)
"""


def build(root: str, steps: int, tensors: int) -> float:
    import torch

    from hyper_parallel.core.distributed_checkpoint import CheckpointManager

    manager = CheckpointManager(root, incremental=True)
    state = {f"layer{i}.weight": torch.randn(64, 64) for i in range(tensors)}
    t = time.perf_counter()
    for step in range(1, steps + 1):
        state[f"layer{step % tensors}.weight"].add_(1)
        manager.save(step, state, metrics={"loss": 1.0 / step})
    manager.close()
    return time.perf_counter() - t


def open_once(root: str) -> tuple[float, int | None]:
    out = subprocess.run([sys.executable, "-c", _OPEN, root], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    seconds, latest = out.stdout.split()
    return float(seconds), None if latest == "None" else int(latest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--tensors", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-manager-open-")
    try:
        made = build(root, args.steps, args.tensors)
        meta = os.path.getsize(os.path.join(root, sorted(d for d in os.listdir(root) if not d.startswith("."))[-1],
                                            ".metadata"))
        times = []
        for _ in range(args.reps):
            seconds, latest = open_once(root)
            assert latest == args.steps, (latest, args.steps)
            times.append(seconds)
        median = statistics.median(times)
        print(f"{args.steps} committed incremental steps of {args.tensors} tensors (.metadata {meta} B each), "
              f"built in {made:.1f} s")
        print(f"open + latest_step: median {median:.3f} s of {args.reps} ({', '.join(f'{t:.3f}' for t in times)}); "
              f"target <= {TARGET_S} s: {'met' if median <= TARGET_S else f'NOT met ({median / TARGET_S:.2f}x)'}")
        names = sorted(d for d in os.listdir(root) if not d.startswith("."))
        shutil.rmtree(os.path.join(root, names[-1]))  # the newest step deleted
        _, latest = open_once(root)
        print(f"newest step deleted -> latest_step {latest} (expected {args.steps - 1})")
        assert latest == args.steps - 1
        with open(os.path.join(root, names[-2], ".metadata"), "r+b") as f:  # now the newest: corrupt it
            f.seek(40)
            f.write(b"#")
        _, latest = open_once(root)
        print(f"newest remaining step's .metadata corrupted -> latest_step {latest} (expected {args.steps - 2}; "
              "the corrupt step is kept, not counted)")
        assert latest == args.steps - 2
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
