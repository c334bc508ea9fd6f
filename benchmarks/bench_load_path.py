#!/usr/bin/env python
"""Load hot path (issue 33): our cold loads against the paired raw read limit, in wall and CPU per GiB.

``N`` gloo ranks (default 2) save a state dict once (``Shard(0)``), then, in each
repetition and in alternating order, from a cold page cache (``fadvise``, these files only):

- ``raw``: each rank reads its share of the checkpoint's data files front to back with
  plain ``readinto`` calls into reused memory (the paired limit: same files, same reps);
- ``same``: our load into the same layout (``Shard(0)``);
- ``s0_s1``: our load into ``Shard(1)`` (each rank wants a column band of every row);
- ``s0_s1_noverify``: the same without checksums;
- ``torch_same``, ``torch_s0_s1``: torch DCP's loads of its own checkpoint of the same state.

Every file (ours and torch's) is read once before the first repetition: on this VM the
first read of freshly written data is slower than later ones even from a dropped cache, so
every reader is timed on files read once (``_Rank.read_once``).

Wall = latest end - earliest start over ranks; CPU = user + system seconds of every thread
of every rank, per GiB of the global state. Printed: the median of ``--reps`` for each
variant, and each load's wall and CPU against ``raw``'s (ratios of medians of one run).

Usage::

    python benchmarks/bench_load_path.py                       # 1 GiB, 26 and 436 tensors, 2 ranks, 3 reps
    python benchmarks/bench_load_path.py --size 256MiB --reps 1 --tensors 436
    python benchmarks/bench_load_path.py --tensors 436 --reps 5 --variants raw,same,s0_s1,torch_same,torch_s0_s1
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks.dcp_common import GiB, TensorSpec, model_specs, parse_size, transformer_specs  # noqa: E402

VARIANTS = ("raw", "same", "s0_s1", "s0_s1_noverify", "torch_same", "torch_s0_s1")


def load_path_ranks(rank: int, ws: int, cfg: dict) -> dict:
    """One rank: save once, then time every variant ``reps`` times (cold)."""
    from benchmarks.dcp_ranks import _Rank

    b = _Rank(rank, ws, cfg)
    specs = [TensorSpec(**s) for s in cfg["specs"]]
    total = sum(s.nbytes for s in specs)
    path = os.path.join(cfg["dir"], "ckpt")
    tpath = os.path.join(cfg["dir"], "ckpt-torch")
    wanted = [v for v in VARIANTS if v in cfg["variants"]]
    sd = b.dtensors(0, fill=True)
    b.ours_save(sd, path)
    if any(v.startswith("torch") for v in wanted):
        b.torch_save(sd, tpath)
    del sd
    b.barrier()
    b.read_once([p for p in (path, tpath) if os.path.isdir(p)])
    b.raw_prepare(path)
    targets = {0: b.dtensors(0, fill=False), 1: b.dtensors(1, fill=False)}
    runs = {
        "raw": (None, b.raw_read),
        "same": (0, lambda p: b.ours_load(targets[0], p)),
        "s0_s1": (1, lambda p: b.ours_load(targets[1], p, verify=True)),
        "s0_s1_noverify": (1, lambda p: b.ours_load(targets[1], p, verify=False)),
        "torch_same": (0, lambda p: b.torch_load(targets[0], tpath)),
        "torch_s0_s1": (1, lambda p: b.torch_load(targets[1], tpath)),
    }
    correct = {}
    for rep in range(cfg["reps"]):
        for name in b.order(rep, wanted):
            dim, fn = runs[name]
            if rep == 0 and dim is not None:
                for v in targets[dim].values():
                    v._local_tensor.zero_()
            rec = b.timed(lambda fn=fn: fn(path), cold=[tpath if name.startswith("torch") else path])
            if rep == 0 and dim is not None:
                correct[name] = b.check(targets[dim], dim)
            b.record("load", name, rec, total)
    for name in cfg.get("profile", []):
        b.make_cold([path])
        _profiled(b, name, lambda fn=runs[name][1]: fn(path))
    timelines = {name: _timeline(b, lambda fn=runs[name][1]: fn(path), path)
                 for name in cfg.get("timeline", []) if name in runs and not name.startswith("torch")}
    b.rmtree(path, tpath)
    return {"records": b.records, "correct": correct, "timelines": timelines}


def _timeline(b, fn, path: str) -> dict:
    """One more cold load with the loader's timeline on (``HP_DCP_LOAD_TIMELINE``): this
    rank's call span, the span of its reading (``read_plan``) inside it, and per kind of
    work (opens, reads, checksums, copies, waits for reads started ahead) the busy seconds
    summed over threads and the seconds during which some thread did it."""
    from hyper_parallel.core.distributed_checkpoint._src.base import timeline

    b.make_cold([path])
    os.environ[timeline.ENV] = "1"
    timeline.take()
    try:
        rec = b.timed(lambda: fn())
    finally:
        del os.environ[timeline.ENV]
    events = timeline.take()
    t0, t1 = rec["t0"], rec["t0"] + rec["rank_s"]
    plans = [e for e in events if e[0] == "read_plan"]
    p0 = min((e[1] for e in plans), default=t0)  # (kind, start, end, cpu, bytes, thread, detail)
    p1 = max((e[2] for e in plans), default=t0)
    return {"wall_s": rec["wall_s"], "rank_s": rec["rank_s"], "before_read_s": p0 - t0, "read_plan_s": p1 - p0,
            "after_read_s": t1 - p1, "kinds": timeline.summary([e for e in events if e[0] != "read_plan"]),
            "threads": len({e[5] for e in events}), "cpu_s": rec["cpu_s"]}



def _profiled(b, name: str, fn) -> None:
    """Run ``fn`` once more on every rank, rank 0 under ``py-spy`` (on-CPU samples of every
    thread, native frames): collapsed stacks in ``<out>/profile-load-<name>.txt``."""
    import signal
    import subprocess

    proc = None
    if b.rank == 0:
        spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
        out = os.path.join(b.cfg["out"], f"profile-load-{name}-{len(b.specs)}.txt")
        proc = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--rate", "500", "--format", "raw",
                                 "--threads", "--native", "-o", out], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(1.5)  # let it attach
    b.barrier()
    fn()
    b.barrier()
    if proc is not None:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def _run(cfg: dict, ws: int) -> list[dict]:
    from benchmarks import dcp_ranks

    # The ranks (forked from dcp_ranks' forkserver) look the function up by name in dcp_ranks:
    # the forkserver imports this module too, which registers it there.
    dcp_ranks._CTX.set_forkserver_preload([
        "torch", "torch.distributed", "hyper_parallel.core.distributed_checkpoint", "benchmarks.dcp_common",
        "benchmarks.dcp_ranks", "benchmarks.bench_load_path"])
    return dcp_ranks.run_ranks("load_path_ranks", ws, cfg)


def _register() -> None:
    from benchmarks import dcp_ranks

    dcp_ranks.load_path_ranks = load_path_ranks


if __name__ != "__main__":
    _register()


def summarise(per_rank: list[dict], total: int) -> dict[str, dict[str, float]]:
    """Per variant: median wall (s), GiB/s, CPU s/GiB (all ranks) over the repetitions."""
    out = {}
    variants = per_rank[0]["records"]["load"]
    for name, reps in variants.items():
        walls = [r["wall_s"] for r in reps]
        cpus = [sum(pr["records"]["load"][name][i]["cpu_s"] for pr in per_rank) for i in range(len(reps))]
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        out[name] = {"wall_s": wall, "gib_s": total / GiB / wall, "cpu_s_per_gib": cpu / (total / GiB),
                     "walls": walls}
    return out


TORCH_OF = {"same": "torch_same", "s0_s1": "torch_s0_s1", "s0_s1_noverify": "torch_s0_s1"}


def render(results: dict, command: str, ws: int, reps: int, loads: str = "") -> str:
    lines = [f"Command: `{command}` ({ws} gloo ranks, {reps} reps each, alternating, files read once, then "
             f"a cold page cache via fadvise before each; medians; ratios from the same run{loads})", "",
             "| tensors | variant | GiB/s | wall s | wall vs raw | vs torch DCP | CPU s/GiB | CPU vs raw "
             "| correct | walls s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for n, (summary, correct) in results.items():
        raw = summary.get("raw")
        for name in VARIANTS:
            s = summary.get(name)
            if s is None:
                continue
            speed = f"{raw['wall_s'] / s['wall_s']:.2f}x" if raw and name != "raw" else "–"
            cpu = f"{s['cpu_s_per_gib'] / raw['cpu_s_per_gib']:.2f}x" if raw and name != "raw" else "–"
            theirs = summary.get(TORCH_OF.get(name, ""))
            vs_torch = f"{theirs['wall_s'] / s['wall_s']:.2f}x" if theirs else "–"
            ok = {True: "yes", False: "NO"}.get(correct.get(name), "–")
            walls = " ".join(f"{w:.3f}" for w in s["walls"])
            lines.append(f"| {n} | {name} | {s['gib_s']:.2f} | {s['wall_s']:.3f} | {speed} | {vs_torch} | "
                         f"{s['cpu_s_per_gib']:.2f} | {cpu} | {ok} | {walls} |")
    return "\n".join(lines)


def render_timelines(n: int, per_rank: list[dict]) -> str:
    """Each rank's timeline of one cold load: seconds before, in and after its reading, and
    per kind of work: count, MiB, busy seconds (all threads), seconds with some thread at it."""
    lines = [f"Timeline of one cold load per rank ({n} tensors; HP_DCP_LOAD_TIMELINE):", "",
             "| variant | rank | wall s | rank s | before read_plan s | read_plan s | after (waits on peer) s | "
             "threads | rank CPU s | work: count / MiB / busy s / CPU s / span s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in per_rank[0].get("timelines", {}):
        for r, pr in enumerate(per_rank):
            t = pr["timelines"][name]
            work = "; ".join(f"{k} {v['count']} / {v['bytes'] / (1 << 20):.0f} / {v['busy_s']:.3f} / "
                             f"{v['cpu_s']:.3f} / {v['span_s']:.3f}" for k, v in sorted(t["kinds"].items()))
            lines.append(f"| {name} | {r} | {t['wall_s']:.3f} | {t['rank_s']:.3f} | {t['before_read_s']:.3f} | "
                         f"{t['read_plan_s']:.3f} | {t['after_read_s']:.3f} | {t['threads']} | {t['cpu_s']:.3f} | "
                         f"{work} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1GiB", help="global state size (default 1GiB)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tensors", default="26,436", help="state dicts: 26 (transformer_specs) and/or 436 (model_specs)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="which of " + ",".join(VARIANTS))
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--profile", default="", help="variants to run once more with rank 0 under py-spy")
    ap.add_argument("--out", default=tempfile.gettempdir(), help="where profiles go")
    ap.add_argument("--timeline", default="",
                    help="our variants to run once more with the loader's timeline on (HP_DCP_LOAD_TIMELINE): "
                         "each rank's opens, reads, checksums, copies, waits, and the time outside its reading")
    ap.add_argument("--io-chunk", default="64MiB", help="bytes per readinto call of the raw limit")
    a = ap.parse_args(argv)
    size = parse_size(a.size)
    command = "python benchmarks/bench_load_path.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results = {}
    loads = [os.getloadavg()[0]]
    for n in [int(x) for x in a.tensors.split(",") if x]:
        specs = transformer_specs(size) if n == 26 else model_specs(size, (n - 4) // 12)
        total = sum(s.nbytes for s in specs)
        storage = tempfile.mkdtemp(prefix="hp-load-path-", dir=a.dir)
        cfg = {"dir": storage, "specs": [asdict(s) for s in specs], "reps": a.reps, "cold": "fadvise",
               "io_chunk": parse_size(a.io_chunk), "variants": a.variants.split(","),
               "profile": [v for v in a.profile.split(",") if v], "out": a.out,
               "timeline": [v for v in a.timeline.split(",") if v]}
        print(f"[bench] {len(specs)} tensors, {total / GiB:.3f} GiB, {a.world_size} ranks, load average "
              f"{os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            per_rank = _run(cfg, a.world_size)
        finally:
            shutil.rmtree(storage, ignore_errors=True)
        results[len(specs)] = (summarise(per_rank, total), per_rank[0]["correct"])
        if a.timeline:
            print(render_timelines(len(specs), per_rank))
        loads.append(os.getloadavg()[0])
        print(f"[bench] done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    print(render(results, command, a.world_size, a.reps,
                 f"; 1-min load average {' -> '.join(f'{x:.2f}' for x in loads)} on {os.cpu_count()} cores"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
