"""Async saves of accelerator tensors (issue 33, GPU paths): D2H speed, blocking time, compute lost.

One process saves a state of ``--tensors`` tensors (``--size-mb`` in all) that live on
``--device`` (``cuda`` by default) with ``no_dist`` async saves, ``--reps`` times each, and
prints, as medians of saves 2.. (the first one allocates the staging buffers):

- the machine's limits: device-to-host copies of the state into pageable and into pinned
  memory (GiB/s), and one copy of it into a reused pinned buffer (s), the "one memcpy" an
  async save's blocking time is held to;
- ``ours eager``: :class:`AsyncCheckpointer` ``save`` (staging="eager"): blocking (the call),
  total (until committed), and the staging buffers allocated over all saves (a reused pinned
  pool allocates once);
- ``ours budget``: the same with ``max_host_bytes`` = ``--budget-fraction`` of the state:
  pieces copied to the host on a side stream while earlier ones are written; peak staged;
- ``torch DCP``: ``torch.distributed.checkpoint.async_save`` (its default stager);
- compute lost per save: a fixed loop of matmuls on the device is timed alone and again
  right after each save call, while the save runs in the background; lost = blocking +
  (loop time during the save - loop time alone).

Targets (issue 33): blocking <= 1.2x one pinned memcpy; compute lost <= 1/5 of torch DCP's;
under a budget, peak staged <= budget + 10%; one staging allocation across saves.

Usage::

    python benchmarks/bench_gpu_staging.py                      # on a CUDA machine (scripts/gpu_check.sh runs it)
    python benchmarks/bench_gpu_staging.py --device cpu --size-mb 32 --tensors 8 --reps 2   # smoke run, no GPU
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.common import table_head, table_row  # noqa: E402
from hyper_parallel.core.distributed_checkpoint import AsyncCheckpointer, load  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


def build_state(device: str, size_mb: float, tensors: int) -> dict[str, torch.Tensor]:
    """``tensors`` fp32 matrices of 1024 columns, ``size_mb`` in all, on ``device``."""
    rows = max(1, int(size_mb * MiB / 4 / 1024 / tensors))
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(rows, 1024, generator=g).to(device) for i in range(tensors)}


def sync(device: str) -> None:
    if device != "cpu":
        torch.accelerator.synchronize()


def d2h(state: dict[str, torch.Tensor], pinned: bool, device: str, reps: int) -> float:
    """Seconds to copy every tensor into host memory allocated once (pinned or pageable)."""
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pinned) for k, v in state.items()}
    times = []
    for _ in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        for k, v in state.items():
            host[k].copy_(v, non_blocking=pinned)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


class Compute:
    """A fixed loop of matmuls on the device: what a training step does meanwhile."""

    def __init__(self, device: str, n: int, iters: int):
        self.device, self.iters = device, iters
        self.a = torch.randn(n, n, device=device)
        self.alone = min(self.run() for _ in range(3))

    def run(self) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        x = self.a
        for _ in range(self.iters):
            x = torch.tanh(x @ self.a)
        sync(self.device)
        return time.perf_counter() - t0


def run_ours(state: dict, root: str, reps: int, compute: Compute, max_host_bytes: int | None) -> dict:
    ckpt = AsyncCheckpointer(max_host_bytes=max_host_bytes)
    rows = []
    try:
        for i in range(reps):
            path = os.path.join(root, f"ours-{max_host_bytes}-{i}")
            t0 = time.perf_counter()
            resp = ckpt.save(state, path, no_dist=True)
            blocking = time.perf_counter() - t0
            busy = compute.run()
            resp.result()
            total = time.perf_counter() - t0
            rows.append(dict(blocking=blocking, total=total, lost=blocking + max(0.0, busy - compute.alone),
                             peak=resp.peak_staged_bytes or 0))
            if i == reps - 1:
                out = load(path=path)
                bad = [k for k, v in state.items() if not torch.equal(out[k], v.cpu())]
                assert not bad, f"{path}: {bad[:3]} differ from the state saved"
            shutil.rmtree(path, ignore_errors=True)
        stats = ckpt.stats
    finally:
        ckpt.close()
    later = rows[1:] or rows
    return dict(blocking=statistics.median(r["blocking"] for r in later),
                total=statistics.median(r["total"] for r in later),
                lost=statistics.median(r["lost"] for r in later),
                peak=max(r["peak"] for r in rows), allocations=stats.allocations)


def run_torch(state: dict, root: str, reps: int, compute: Compute) -> dict:
    import torch.distributed.checkpoint as tdcp

    rows = []
    for i in range(reps):
        path = os.path.join(root, f"torch-{i}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            fut = tdcp.async_save(state, checkpoint_id=path, no_dist=True)
            blocking = time.perf_counter() - t0
            busy = compute.run()
            (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
        total = time.perf_counter() - t0
        rows.append(dict(blocking=blocking, total=total, lost=blocking + max(0.0, busy - compute.alone)))
        shutil.rmtree(path, ignore_errors=True)
    later = rows[1:] or rows
    return {k: statistics.median(r[k] for r in later) for k in ("blocking", "total", "lost")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="where the state lives (cuda; cpu for a smoke run)")
    ap.add_argument("--size-mb", type=float, default=2048)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--reps", type=int, default=4, help="saves per way (the first allocates buffers)")
    ap.add_argument("--budget-fraction", type=float, default=0.25)
    ap.add_argument("--compute-n", type=int, default=4096, help="matmul size of the compute loop")
    ap.add_argument("--compute-iters", type=int, default=50)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out", default=None, help="also write the report (markdown) here")
    args = ap.parse_args(argv)
    if args.device != "cpu" and not (torch.accelerator.is_available()
                                      and torch.accelerator.current_accelerator().type == args.device):
        print(f"no {args.device} device here (pass --device cpu for a smoke run)", file=sys.stderr)
        return 2
    gpu = args.device != "cpu"
    state = build_state(args.device, args.size_mb, args.tensors)
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    budget = max(32 * MiB, int(nbytes * args.budget_fraction) // 4096 * 4096)
    root = tempfile.mkdtemp(prefix="hp_bench_gpu_", dir=args.dir)
    try:
        pageable = d2h(state, False, args.device, args.reps)
        pinned = d2h(state, True, args.device, args.reps) if gpu else None
        compute = Compute(args.device, args.compute_n, args.compute_iters)
        eager = run_ours(state, root, args.reps, compute, None)
        bounded = run_ours(state, root, args.reps, compute, budget)
        theirs = None if args.no_torch else run_torch(state, root, args.reps, compute)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    memcpy = pinned if pinned is not None else pageable
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    lines = [f"# Async saves of {args.device} tensors — {datetime.datetime.now():%Y-%m-%d %H:%M}", "",
             f"`python benchmarks/bench_gpu_staging.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"device: {name}; torch {torch.__version__}; state {nbytes / MiB:.0f} MiB in {len(state)} tensors; "
             f"{args.reps} saves per way, medians of saves 2..; compute loop alone {compute.alone * 1e3:.1f} ms", "",
             f"- D2H into pageable memory: {nbytes / GiB / pageable:.2f} GiB/s ({pageable * 1e3:.1f} ms)"]
    if pinned is not None:
        lines.append(f"- D2H into pinned memory (one memcpy): {nbytes / GiB / pinned:.2f} GiB/s "
                     f"({pinned * 1e3:.1f} ms)")
    lines += ["", *table_head("way", "blocking (ms)", "total (ms)", "compute lost (ms)", "peak staged (MiB)",
                              "staging allocations")]
    lines.append(table_row("ours eager", f"{eager['blocking'] * 1e3:.1f}", f"{eager['total'] * 1e3:.1f}",
                           f"{eager['lost'] * 1e3:.1f}", f"{eager['peak'] / MiB:.1f}", eager["allocations"]))
    lines.append(table_row(f"ours, max_host_bytes={budget / MiB:.0f} MiB", f"{bounded['blocking'] * 1e3:.1f}",
                           f"{bounded['total'] * 1e3:.1f}", f"{bounded['lost'] * 1e3:.1f}",
                           f"{bounded['peak'] / MiB:.1f}", bounded["allocations"]))
    if theirs is not None:
        lines.append(table_row("torch DCP async_save", f"{theirs['blocking'] * 1e3:.1f}",
                               f"{theirs['total'] * 1e3:.1f}", f"{theirs['lost'] * 1e3:.1f}", "-", "-"))
    checks = [("eager blocking <= 1.2x one memcpy", eager["blocking"] <= 1.2 * memcpy,
               f"{eager['blocking'] * 1e3:.1f} ms vs {memcpy * 1e3:.1f} ms"),
              ("staging buffers reused across saves (1 allocation)", eager["allocations"] == 1,
               f"{eager['allocations']} allocations"),
              ("budget: peak staged <= budget + 10%", bounded["peak"] <= 1.1 * budget,
               f"{bounded['peak'] / MiB:.1f} MiB vs {budget / MiB:.0f} MiB")]
    if theirs is not None:
        checks.append(("compute lost <= 1/5 of torch DCP's", eager["lost"] <= theirs["lost"] / 5,
                       f"{eager['lost'] * 1e3:.1f} ms vs {theirs['lost'] * 1e3:.1f} ms"))
    lines += ["", "Targets:"] + [f"- {what}: {'met' if ok else 'NOT met'} ({detail})" for what, ok, detail in checks]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
