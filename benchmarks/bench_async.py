"""How long training pauses for a checkpoint: sync save vs async_save (eager and lazy) vs torch DCP.

Runs ``--world-size`` gloo ranks (separate processes) on one sharded state dict shaped like a
model plus Adam state (Shard(0) DTensors, ``--size-mb`` in total, so each rank holds
``size/world`` MB). Each repetition follows a training job that saves and loads in turn
(issue 47 item 2): it loads the state in place from a checkpoint (ours, ``load``), then times

- async eager, after a load:  the first ``async_save()`` call after that load
- async eager blocking:       the next call (steady state: nothing changed in between)
- async eager total:          that call until ``result()`` returns (committed)
- async eager background CPU: CPU seconds of the rank's other threads from that call to the commit
- async lazy blocking:        ``async_save(staging="lazy")`` call
- async eager, stage_bands=False (a flat snapshot; the saver gathers the column bands in the background)
- memcpy:                     one flat copy of the rank's local bytes into reused memory
- torch DCP async:            ``torch.distributed.checkpoint.async_save`` call (blocking part)
- sync save:                  ``save()`` until committed

and prints, as the median over ``--reps`` of the slowest rank, each figure and the ratios
the targets need: every eager call (the one after a load included) <= 1.2x memcpy and
<= 0.15x torch DCP's call in the same run; lazy blocking <= 5% of the sync save. Every
async measurement starts with nothing in flight (the previous save is waited for outside
the timed region) and follows a warm-up save, so buffers, the dedicated gloo group and
cached plans exist, as they do from the second checkpoint of a training run on. The load
average before and after is printed: on shared cores, compare ratios, not times.

``--budget`` measures memory instead: each way of saving runs in fresh rank processes
(``AsyncCheckpointer(max_host_bytes=...)`` at ``--budget-fraction`` of a rank's state,
eager and lazy, beside the unbounded async save, a sync save and torch DCP's async_save),
and reports per rank the peak extra RSS over two saves (the kernel's ``VmHWM``, reset through
``/proc/self/clear_refs`` once the state is built, minus ``VmRSS`` then), the blocking time
and the total time of the second save; one run. Target: the budgeted saves' peak extra RSS
<= budget + 10%.

Usage::

    python benchmarks/bench_async.py --size-mb 1024 --world-size 2 --reps 5
    python benchmarks/bench_async.py --size-mb 512 --cols 4096   # wider rows: band rows of 4 KiB, not 1 KiB
    python benchmarks/bench_async.py --budget --size-mb 2048 --world-size 2 --out benchmarks/results/async_budget.md
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import bar_chart, slowest, text_table  # noqa: E402

METRICS = [
    ("load", "load (ours, in place) before the saves"),
    ("eager_after_load", "async eager: blocking, first call after a load"),
    ("eager_after_load_cpu", "async eager: CPU s of that call (caller's thread)"),
    ("eager_blocking", "async eager: blocking, next call"),
    ("eager_call_cpu", "async eager: CPU s of that call (caller's thread)"),
    ("eager_copies", "async eager: snapshot copies (in blocking)"),
    ("eager_total", "async eager: total (committed)"),
    ("eager_bg_cpu", "async eager: background CPU s (call to commit)"),
    ("lazy_blocking", "async lazy: blocking"),
    ("lazy_total", "async lazy: total (committed)"),
    ("flat_blocking", "async eager, stage_bands=False: blocking"),
    ("flat_call_cpu", "async eager, stage_bands=False: CPU s of the call"),
    ("flat_total", "async eager, stage_bands=False: total"),
    ("flat_bg_cpu", "async eager, stage_bands=False: background CPU s"),
    ("memcpy", "memcpy of local bytes (torch copy_)"),
    ("memmove", "memcpy of local bytes (libc memmove)"),
    ("memcpy_cpu", "memcpy (torch copy_): CPU s"),
    ("torch_blocking", "torch DCP async_save: blocking"),
    ("torch_total", "torch DCP async_save: total"),
    ("sync_save", "sync save (committed)"),
]


def build_state(ws: int, size_mb: float, tensors: int, cols: int = 1024):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    rows = max(ws, int(size_mb * (1 << 20) / 4 / cols / tensors))
    per_group = max(1, tensors // 3)
    sd = {"model": {}, "optim": {"state": {}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]}, "step": 0}
    for i in range(per_group):
        g = torch.Generator().manual_seed(i)
        sd["model"][f"layer{i}.weight"] = distribute_tensor(torch.randn(rows, cols, generator=g), mesh, [Shard(0)])
        sd["optim"]["state"][i] = {
            "exp_avg": distribute_tensor(torch.randn(rows, cols, generator=g), mesh, [Shard(0)]),
            "exp_avg_sq": distribute_tensor(torch.rand(rows, cols, generator=g), mesh, [Shard(0)]),
        }
    return sd


def local_bytes(sd) -> int:
    import torch
    from torch.distributed.tensor import DTensor

    total = 0

    def walk(v):
        nonlocal total
        if isinstance(v, DTensor):
            total += v.to_local().numel() * v.element_size()
        elif isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    walk(sd)
    return total


def _cpu(who: int) -> float:
    """User + system CPU seconds of this process (``RUSAGE_SELF``) or this thread (``RUSAGE_THREAD``)."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def bench_rank(rank: int, ws: int, args: argparse.Namespace, root: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp

    from hyper_parallel.core.distributed_checkpoint import AsyncCheckpointer, load, save

    warnings.filterwarnings("ignore")
    sd = build_state(ws, args.size_mb, args.tensors, args.cols)
    nbytes = local_bytes(sd)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    ckpt = AsyncCheckpointer()
    flat = AsyncCheckpointer(stage_bands=False)  # a flat snapshot: the column bands are gathered in the background
    times: dict[str, list[float]] = {k: [] for k, _ in METRICS}
    after_load_allocs: list[int] = []  # staging buffers the first call after each load allocated
    counter = iter(range(1 << 30))
    loaded_from = os.path.join(root, "load-source")  # the checkpoint every repetition loads

    def fresh(kind: str) -> str:
        return os.path.join(root, f"{kind}-{next(counter)}")

    def clean() -> None:
        dist.barrier()
        if rank == 0:
            for name in os.listdir(root):
                if name != os.path.basename(loaded_from):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        dist.barrier()

    def timed_async(kind: str, staging: str, record: str | None) -> None:
        dist.barrier()
        cpu0, own0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_THREAD)
        t0 = time.perf_counter()
        resp = (flat if kind == "flat" else ckpt).save(sd, fresh(kind), staging=staging)
        t1 = time.perf_counter()
        call_cpu = _cpu(resource.RUSAGE_THREAD) - own0
        resp.result()
        t2 = time.perf_counter()
        background = (_cpu(resource.RUSAGE_SELF) - cpu0) - (_cpu(resource.RUSAGE_THREAD) - own0)
        if record == "after_load":
            times["eager_after_load"].append(t1 - t0)
            times["eager_after_load_cpu"].append(call_cpu)
        elif record:
            times[f"{kind}_blocking"].append(t1 - t0)
            times[f"{kind}_total"].append(t2 - t0)
            if kind == "eager":
                times["eager_copies"].append(resp.staging_s)
            if kind in ("eager", "flat"):
                times[f"{kind}_bg_cpu"].append(background)
                times[f"{kind}_call_cpu"].append(call_cpu)

    def timed_torch(record: bool) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        fut = tdcp.async_save(sd, checkpoint_id=fresh("torch"))
        t1 = time.perf_counter()
        (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
        t2 = time.perf_counter()
        if record:
            times["torch_blocking"].append(t1 - t0)
            times["torch_total"].append(t2 - t0)

    def timed_copies(record: bool) -> None:
        dist.barrier()
        own0 = _cpu(resource.RUSAGE_THREAD)
        t0 = time.perf_counter()
        dst.copy_(src)
        t1 = time.perf_counter()
        own1 = _cpu(resource.RUSAGE_THREAD)
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        t2 = time.perf_counter()
        if record:
            times["memcpy"].append(t1 - t0)
            times["memmove"].append(t2 - t1)
            times["memcpy_cpu"].append(own1 - own0)

    def timed_load() -> None:
        dist.barrier()
        t0 = time.perf_counter()
        load(sd, loaded_from)
        times["load"].append(time.perf_counter() - t0)

    # warm-up: page in the buffers, make the dedicated group, cache the plans, start threads
    save(sd, loaded_from)
    timed_async("eager", "eager", None)
    timed_async("lazy", "lazy", None)
    timed_async("flat", "eager", None)
    timed_torch(False)
    timed_copies(False)
    clean()
    for _ in range(args.reps):  # interleaved, so drifting machine load hits every method alike
        timed_load()  # the job loads (resumes, or reads an evaluation copy) in place ...
        before = ckpt.stats.allocations
        timed_async("eager", "eager", "after_load")  # ... then saves: the first call after the load
        after_load_allocs.append(ckpt.stats.allocations - before)
        timed_async("eager", "eager", "steady")
        timed_torch(True)
        timed_copies(True)
        timed_async("lazy", "lazy", "steady")
        timed_async("flat", "eager", "steady")
        dist.barrier()
        t0 = time.perf_counter()
        save(sd, fresh("sync"))
        times["sync_save"].append(time.perf_counter() - t0)
        clean()
    stats = ckpt.stats
    ckpt.close()
    flat.close()
    return {"times": times, "local_bytes": nbytes, "allocations": stats.allocations,
            "after_load_allocations": after_load_allocs}


BUDGET_SCENARIOS = [
    ("sync", "sync save (no staging: the writer's own memory)"),
    ("unbounded", "async eager, no bound"),
    ("budget_eager", "async eager, max_host_bytes"),
    ("budget_lazy", "async lazy, max_host_bytes (blocking = call + wait_staged)"),
    ("torch", "torch DCP async_save"),
]


def _proc_status(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def budget_rank(rank: int, ws: int, args: argparse.Namespace, root: str) -> dict:
    """One scenario (``args.scenario``) in fresh processes: two saves, peak extra RSS over both."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp

    from hyper_parallel.core.distributed_checkpoint import AsyncCheckpointer, save

    warnings.filterwarnings("ignore")
    sd = build_state(ws, args.size_mb, args.tensors, args.cols)
    nbytes = local_bytes(sd)
    budget = int(nbytes * args.budget_fraction)
    kind = args.scenario
    ckpt = AsyncCheckpointer(max_host_bytes=budget if kind.startswith("budget") else None)
    dist.barrier()
    base = _proc_status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS now
        f.write("5")
    out = {"local_bytes": nbytes, "budget": budget}
    for i in range(2):  # the first allocates what the way of saving keeps; the second is timed
        path = os.path.join(root, f"{kind}-{i}")
        dist.barrier()
        t0 = time.perf_counter()
        if kind == "sync":
            save(sd, path)
            t1 = t2 = time.perf_counter()
        elif kind == "torch":
            fut = tdcp.async_save(sd, checkpoint_id=path)
            t1 = time.perf_counter()
            (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
            t2 = time.perf_counter()
        else:
            resp = ckpt.save(sd, path, staging="lazy" if kind == "budget_lazy" else "eager")
            resp.wait_staged()  # lazy: what an optimizer step right after the call would wait
            t1 = time.perf_counter()
            resp.result()
            t2 = time.perf_counter()
            out["peak_staged"] = resp.peak_staged_bytes
            if kind == "budget_lazy":
                out["call_s"] = resp.blocking_s
        out.update(blocking_s=t1 - t0, total_s=t2 - t0)
    out["peak_extra"] = _proc_status("VmHWM") - base
    ckpt.close()
    return out


def _worker(rank: int, ws: int, init_file: str, args: argparse.Namespace, root: str, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws,
                                timeout=timedelta(seconds=300))
        q.put((rank, "ok", (budget_rank if args.budget else bench_rank)(rank, ws, args, root)))
        dist.destroy_process_group()
    except BaseException:
        q.put((rank, "err", traceback.format_exc()))


def run(args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    root = tempfile.mkdtemp(prefix="bench_async_", dir=args.dir)
    init_file = os.path.join(tempfile.mkdtemp(prefix="bench_store_"), "store")
    procs = [ctx.Process(target=_worker, args=(r, args.world_size, init_file, args, root, q))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    try:
        while len(results) < args.world_size:
            rank, kind, payload = q.get()
            if kind != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(os.path.dirname(init_file), ignore_errors=True)
    return [results[r] for r in range(args.world_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=256.0, help="state dict size over all ranks")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tensors", type=int, default=48, help="number of tensors (model + 2 Adam states)")
    parser.add_argument("--cols", type=int, default=1024,
                        help="columns of every tensor (a band's row is cols/4 elements: wider rows copy faster)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: temp dir)")
    parser.add_argument("--verbose", action="store_true", help="also print every repetition")
    parser.add_argument("--budget", action="store_true", help="measure peak extra RSS under max_host_bytes")
    parser.add_argument("--budget-fraction", type=float, default=0.25, help="max_host_bytes / a rank's state")
    parser.add_argument("--out", default=None, help="--budget: also write the table (markdown) here")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="also draw how long each way blocks the caller (e.g. docs/assets/async_blocking.png)")
    args = parser.parse_args()
    if args.budget:
        budget_main(args)
        return

    load_before = os.getloadavg()
    ranks = run(args)
    load_after = os.getloadavg()
    # per repetition, the slowest rank decides how long training paused; then the median
    per_rep = {key: slowest([r["times"][key] for r in ranks]) for key, _ in METRICS}
    med = {key: statistics.median(per_rep[key]) for key, _ in METRICS}
    mb = ranks[0]["local_bytes"] / (1 << 20)
    print(f"state dict: {args.size_mb:g} MB over {args.world_size} ranks ({mb:.1f} MB local per rank, "
          f"{args.tensors} tensors of {args.cols} columns), {args.reps} reps, {args.threads} torch thread(s) per rank; "
          f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, after {load_after[0]:.2f} "
          f"{load_after[1]:.2f} ({os.cpu_count()} cores)")
    print(f"staging allocations per rank over all saves: {[r['allocations'] for r in ranks]}; "
          f"by the first call after each load: {[r['after_load_allocations'] for r in ranks]}")
    header = ["median of the slowest rank", "ms"] + (["every repetition (ms)"] if args.verbose else [])
    print(text_table(header, [[label, f"{med[key] * 1e3:.2f}"]
                              + ([" ".join(f"{t * 1e3:.1f}" for t in per_rep[key])] if args.verbose else [])
                              for key, label in METRICS]))
    memcpy = min(med["memcpy"], med["memmove"])
    gib = ranks[0]["local_bytes"] / (1 << 30)
    print(f"background CPU per GiB of a rank's state (call to commit): eager {med['eager_bg_cpu'] / gib:.3f} s, "
          f"stage_bands=False {med['flat_bg_cpu'] / gib:.3f} s")
    # the ratios per repetition too (the same repetition's memcpy and torch call), then their median
    for key, label in (("eager_after_load", "after a load"), ("eager_blocking", "next call"),
                       ("flat_blocking", "stage_bands=False")):
        per_memcpy = [c / min(m, v) for c, m, v in zip(per_rep[key], per_rep["memcpy"], per_rep["memmove"],
                                                        strict=True)]
        per_torch = [c / t for c, t in zip(per_rep[key], per_rep["torch_blocking"], strict=True)]
        print(f"eager call, {label}: {statistics.median(per_memcpy):.2f}x memcpy, "
              f"{statistics.median(per_torch):.3f}x torch DCP's call (medians of the per-repetition ratios)")
    # CPU time is what the call costs whatever the machine's load; wall time is what training waits
    cpu_memcpy = med["memcpy_cpu"]
    print(f"CPU of the call / CPU of the memcpy: eager after a load {med['eager_after_load_cpu'] / cpu_memcpy:.2f}, "
          f"next call {med['eager_call_cpu'] / cpu_memcpy:.2f}, stage_bands=False "
          f"{med['flat_call_cpu'] / cpu_memcpy:.2f}")
    if args.plot:
        bars = [("sync save (committed)", med["sync_save"]),
                ("torch DCP async_save: call", med["torch_blocking"]),
                ("ours: call, first after a load", med["eager_after_load"]),
                ("ours: call, next", med["eager_blocking"]),
                ("ours, stage_bands=False: call", med["flat_blocking"]),
                ("ours, lazy staging: call", med["lazy_blocking"]),
                ("one memcpy of the rank's bytes", memcpy)]
        drawn = bar_chart(args.plot, f"How long an async save blocks the caller: {mb:.0f} MiB per rank, "
                          f"{args.world_size} ranks", [(label, v * 1e3) for label, v in bars],
                          "milliseconds (median of the slowest rank)",
                          f"benchmarks/bench_async.py --size-mb {args.size_mb:g} --reps {args.reps}; load average "
                          f"{load_before[0]:.1f} -> {load_after[0]:.1f} on {os.cpu_count()} cores")
        print(f"chart: {drawn}" if drawn else "no chart: matplotlib is not installed")
    targets = [
        ("eager call after a load <= 1.2x memcpy", med["eager_after_load"], 1.2 * memcpy),
        ("eager call (next) <= 1.2x memcpy", med["eager_blocking"], 1.2 * memcpy),
        ("eager call after a load <= 0.15x torch DCP's call", med["eager_after_load"], 0.15 * med["torch_blocking"]),
        ("eager call (next) <= 0.15x torch DCP's call", med["eager_blocking"], 0.15 * med["torch_blocking"]),
        ("lazy blocking <= 5% of sync save", med["lazy_blocking"], 0.05 * med["sync_save"]),
    ]
    print("targets (memcpy = the faster of the two copies; medians of the slowest rank):")
    for name, value, limit in targets:
        verdict = "met" if value <= limit else "NOT met"
        print(f"  {name:<50} {value * 1e3:8.2f} ms vs {limit * 1e3:8.2f} ms: {verdict}")


def budget_main(args: argparse.Namespace) -> None:
    MiB = 1 << 20
    started = time.perf_counter()
    load = os.getloadavg()
    rows = {}
    for kind, _ in BUDGET_SCENARIOS:  # each in fresh processes: RSS is a process's
        args.scenario = kind
        rows[kind] = run(args)
    ranks = rows["budget_eager"]
    local, budget = ranks[0]["local_bytes"], ranks[0]["budget"]
    lines = [
        f"# Async saves under a host-memory budget ({time.strftime('%Y-%m-%d')})",
        "",
        f"State: {args.size_mb:g} MiB over {args.world_size} gloo ranks ({local / MiB:.1f} MiB per rank, "
        f"{args.tensors} Shard(0) tensors of 1024 columns); max_host_bytes = {budget / MiB:.1f} MiB per rank "
        f"({args.budget_fraction:g} of a rank's state); one run, two saves per way of saving, each way in "
        f"fresh processes; {args.threads} torch thread(s) per rank; load average before {load[0]:.2f}.",
        "Peak extra RSS: the most the rank's resident memory rose above its level with the state built "
        "(kernel VmHWM after a reset through /proc/self/clear_refs), over both saves; times: the second save, "
        "slowest rank.",
        "",
        f"Command: `python benchmarks/bench_async.py --budget --size-mb {args.size_mb:g} --world-size "
        f"{args.world_size} --tensors {args.tensors} --budget-fraction {args.budget_fraction:g}`",
        "",
        "| way of saving | peak extra RSS per rank (MiB) | peak staged (MiB) | blocking (ms) | total (ms) |",
        "|---|---|---|---|---|",
    ]
    for kind, label in BUDGET_SCENARIOS:
        r = rows[kind]
        rss = " / ".join(f"{x['peak_extra'] / MiB:.1f}" for x in r)
        staged = " / ".join(f"{x['peak_staged'] / MiB:.1f}" for x in r) if "peak_staged" in r[0] else "-"
        blocking = max(x["blocking_s"] for x in r) * 1e3
        extra = f" (call {max(x['call_s'] for x in r) * 1e3:.1f})" if "call_s" in r[0] else ""
        total = max(x["total_s"] for x in r) * 1e3
        lines.append(f"| {label} | {rss} | {staged} | {blocking:.1f}{extra} | {total:.1f} |")
    lines += ["", "Targets:"]
    for kind in ("budget_eager", "budget_lazy"):
        worst = max(x["peak_extra"] for x in rows[kind])
        limit = 1.1 * budget
        lines.append(f"- {kind}: peak extra RSS {worst / MiB:.1f} MiB <= budget + 10% ({limit / MiB:.1f} MiB): "
                     f"{'met' if worst <= limit else 'NOT met'}")
    lines.append(f"\n(wall time {time.perf_counter() - started:.0f} s)")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
