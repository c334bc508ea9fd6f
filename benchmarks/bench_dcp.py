#!/usr/bin/env python
"""DCP benchmark: hyper-parallel vs torch.distributed.checkpoint vs this machine's limits.

One invocation, one state dict, one storage directory, one world size:

1. ``2N`` gloo ranks save the checkpoints (ours and torch's) that scenario "2N -> N" loads.
2. ``N`` gloo ranks, started once, run in turn: the raw limits (memcpy into fresh and into
   reused memory; sequential write with and without fsync, one file per rank; cold and warm
   sequential read into preallocated memory); sync save (ours, torch DCP; fsync on); load in
   the same layout; resharded loads (Shard(0)->Shard(1) with verify on and off, 2N ranks ->
   N, N ranks -> 1 process with no_dist); torch.save / safetensors single-process
   references; async save with a matmul loop running (ours if ``async_save`` exists, and
   torch's ``dcp.async_save``). Loads start from a cold page cache, on files every reader
   (ours, torch DCP, raw ``readinto``) has read once before (this VM serves the first read of
   freshly written data slower than later ones, dropped cache or not), alternating.
   Then the model-shaped case: a GPT-like model (117.5 M parameters by default) under FSDP2
   with AdamW stepped once, model + optimizer state through ``get_state_dict`` /
   ``set_state_dict``, saved and loaded (cold) by ours and torch DCP.
3. ``N`` ranks again on a state dict of the same size in 436 tensors (``--many-layers``):
   sync save, same-layout load, Shard(0)->Shard(1) load.
4. 4 ranks (``--hsdp-ranks``), HSDP ``[Replicate(), Shard(0)]`` on a (2, 2) mesh: save, then
   cold loads, with the bytes every rank read beside the checkpoint's size.
5. One process: offline transform (``reshard.reshard``) throughput and peak RSS.
6. Planning + metadata time and size for simulated ranks x tensors (fake process group;
   ``benchmarks/bench_scale.py`` has issue 12's full set).

Every save and load is measured in CPU seconds per GiB (all threads of all ranks) beside
its wall time, for ours, torch DCP and the raw limit; saves and the same-layout and
Shard(0)->Shard(1) loads have a paired raw limit (the same bytes written with ``write`` +
``fsync``, or the same files read with ``readinto``, in the same repetitions).

Results: markdown on stdout and in ``<out>/latest.md`` (the CPU table alone in
``<out>/cpu_per_gib.md``), JSON in ``<out>/latest.json``, a
chart in ``<out>/latest.png`` (needs matplotlib, a dev extra), and each target of issues 13
and 12 (and release 1) printed as met / not met with the measured ratio.

Profiling: ``--profile`` runs our save, loads and the model save/load once more on rank 0
under py-spy (``.venv/bin/pip install py-spy``; all threads, wall clock) and puts the top
frames in the report; without py-spy it falls back to cProfile of the calling thread.

Usage::

    python benchmarks/bench_dcp.py                    # 1 GiB, 2 ranks, 3 repetitions
    python benchmarks/bench_dcp.py --quick            # 64 MiB, 1 repetition, < 60 s
    python benchmarks/bench_dcp.py --size 4GiB --world-size 4 --reps 5 --profile
    python benchmarks/bench_dcp.py --skip model,many,hsdp   # the release-1 set only
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks import dcp_report as report  # noqa: E402
from benchmarks.common import write_json  # noqa: E402
from benchmarks.dcp_common import GiB, MiB, model_specs, parse_size, transformer_specs  # noqa: E402

STEPS = ("prep", "limits", "sync_save", "load_same", "load_reshard_s0_s1", "load_reshard_2n_n", "load_n_1",
         "reference", "async_save", "model", "many", "hsdp", "offline", "planning")
MANY_STEPS = ("sync_save", "load_same", "load_reshard_s0_s1")  # run again on the many-tensor state dict
DEFAULT_BASELINE = os.path.join(ROOT, "benchmarks", "results", "baseline_v1.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=None, help="global state size, e.g. 1GiB (default), 64MiB")
    ap.add_argument("--world-size", type=int, default=2, help="ranks (gloo processes), default 2")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per measurement (default 3)")
    ap.add_argument("--quick", action="store_true", help="64 MiB, 1 repetition, small planning: < 60 s")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints go (a fresh subfolder)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="results folder")
    ap.add_argument("--cold", choices=("auto", "drop_caches", "fadvise"), default="fadvise",
                    help="how to empty the page cache before a load (default fadvise: DONTNEED on the "
                         "load's files only, any user, leaves other processes' caches alone; auto: "
                         "drop_caches if permitted)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed saves of each library first (default 1)")
    ap.add_argument("--io-chunk", default="64MiB", help="bytes per write/read call of the raw limits")
    ap.add_argument("--compute-n", type=int, default=768, help="matmul size of the async compute loop (0: none)")
    ap.add_argument("--compute-s", type=float, default=None, help="seconds of idle compute rate per async run")
    ap.add_argument("--plan-ranks", default=None, help="simulated ranks, default 1024,2048,4096,8192")
    ap.add_argument("--plan-tensors", type=int, default=None, help="simulated tensors, default 1000")
    ap.add_argument("--plan-budget-s", type=float, default=None,
                    help="a planning point predicted to take longer is extrapolated, not run (default 300)")
    ap.add_argument("--ours-save-threads", type=int, default=None, help="save(thread_count=); default: ours")
    ap.add_argument("--ours-load-threads", type=int, default=None, help="load(thread_count=); default: ours")
    ap.add_argument("--model", default=None,
                    help="model-shaped case LAYERS,HIDDEN,VOCAB (default 12,768,21120: 117.5 M parameters)")
    ap.add_argument("--many-layers", type=int, default=36,
                    help="layers of the many-tensor state dict (12 tensors each + 4: 36 -> 436 tensors)")
    ap.add_argument("--hsdp-ranks", type=int, default=4, help="ranks of the replicated (HSDP) load, even (default 4)")
    ap.add_argument("--baseline", default=DEFAULT_BASELINE,
                    help="a previous run's JSON, for targets relative to today (default results/baseline_v1.json)")
    ap.add_argument("--skip", default="", help=f"comma-separated steps to skip: {','.join(STEPS)}")
    ap.add_argument("--profile", action="store_true",
                    help="also run our saves and loads once more under py-spy (rank 0; cProfile without it) "
                         "and summarise the top frames")
    ap.add_argument("--profile-native", action="store_true", help="py-spy --native (C frames too)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--render-only", action="store_true",
                    help="measure nothing: rebuild targets and report from <out>/latest.json (and its profiles)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for each group of ranks")
    a = ap.parse_args(argv)
    quick = a.quick
    a.size_bytes = parse_size(a.size or ("64MiB" if quick else "1GiB"))
    a.reps = a.reps or (1 if quick else 3)
    a.warmup = a.warmup if a.warmup is not None else (0 if quick else 1)
    a.compute_s = a.compute_s if a.compute_s is not None else (0.3 if quick else 1.5)
    a.plan_ranks = a.plan_ranks or ("128,256,512" if quick else "1024,2048,4096,8192")
    a.plan_tensors = a.plan_tensors or (100 if quick else 1000)
    a.plan_budget_s = a.plan_budget_s or (20.0 if quick else 300.0)
    a.io_chunk_bytes = parse_size(a.io_chunk)
    a.model = a.model or ("2,64,512" if quick else "12,768,21120")
    if a.hsdp_ranks and (a.hsdp_ranks < 2 or a.hsdp_ranks % 2):
        ap.error("--hsdp-ranks must be an even number >= 2 (2 replicas)")
    a.skip_set = {s.strip() for s in a.skip.split(",") if s.strip()}
    unknown = a.skip_set - set(STEPS)
    if unknown:
        ap.error(f"unknown --skip steps {sorted(unknown)}; known: {', '.join(STEPS)}")
    if a.world_size < 1:
        ap.error("--world-size must be >= 1")
    return a


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def _fs_type(path: str) -> str:
    best, fs = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, typ, *_ = line.split()
                if path.startswith(mnt) and len(mnt) > len(best):
                    best, fs = mnt, f"{typ} on {dev}"
    except OSError:
        pass
    return fs


def machine_info(storage: str) -> dict:
    import torch

    mem_total = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    git = _run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"])
    dirty = _run(["git", "-C", ROOT, "status", "--porcelain", "--", "hyper_parallel"])
    return {
        "nproc": os.cpu_count(), "mem_total": mem_total, "kernel": f"Linux {platform.release()}",
        "python": platform.python_version(), "torch": torch.__version__,
        "git": git + (" + uncommitted changes in hyper_parallel/" if dirty else ""),
        "fs": _fs_type(os.path.realpath(storage)),
        "uptime_start": _run(["uptime"]), "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def _subprocess_json(args: list[str], timeout: float) -> dict:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())
    sys.stderr.write(proc.stderr[-4000:] if proc.returncode else "".join(
        ln + "\n" for ln in proc.stderr.splitlines() if ln.startswith("[bench]")))
    if proc.returncode:
        return {"error": f"{args[0]} exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.render_only:  # no measurements: redo the report of a finished run
        with open(os.path.join(a.out, "latest.json")) as f:
            doc = json.load(f)
        return finish(doc, a.out, a.baseline, bool(doc.get("profile")) or a.profile)
    from benchmarks.dcp_ranks import RanksFailed, run_ranks

    started = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    t_start = time.monotonic()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.dir, exist_ok=True)
    storage = tempfile.mkdtemp(prefix="hp-dcp-bench-", dir=a.dir)
    machine = machine_info(storage)
    specs = transformer_specs(a.size_bytes)
    total = sum(s.nbytes for s in specs)
    ws = a.world_size
    print(f"[bench] {total / GiB:.3f} GiB in {len(specs)} tensors, {ws} ranks, {a.reps} reps, storage {storage}; "
          f"load average {machine['loadavg_start']}", file=sys.stderr, flush=True)
    cfg = {
        "dir": storage, "out": os.path.abspath(a.out), "specs": [asdict(s) for s in specs], "reps": a.reps,
        "warmup": a.warmup, "warmup_async": a.warmup, "cold": a.cold, "io_chunk": a.io_chunk_bytes,
        "compute_n": a.compute_n, "compute_s": a.compute_s, "profile": a.profile,
        "profile_native": a.profile_native, "ours_save_threads": a.ours_save_threads,
        "ours_load_threads": a.ours_load_threads, "skip": sorted(a.skip_set),
        "prep_paths": {"ours": os.path.join(storage, f"prep-{2 * ws}ranks-ours"),
                       "torch": os.path.join(storage, f"prep-{2 * ws}ranks-torch")},
        "model": a.model,
    }
    from benchmarks import dcp_model

    model_params = dcp_model.param_count(*dcp_model.parse_model(a.model))
    bytecheckpoint = ("ByteCheckpoint is installed but not wired in here: not compared."
                      if importlib.util.find_spec("bytecheckpoint") else
                      "ByteCheckpoint is not installed: not compared.")
    notes: list[str] = []
    doc: dict = {"started": started, "command": "python benchmarks/bench_dcp.py " + shlex.join(
        argv if argv is not None else sys.argv[1:]), "notes": notes}
    try:
        if "prep" not in a.skip_set and "load_reshard_2n_n" not in a.skip_set:
            try:
                prep = run_ranks("prep_ranks", 2 * ws, cfg, timeout_s=a.timeout)
                notes.append(f"{2 * ws}-rank checkpoints saved for the {2 * ws} -> {ws} loads: ours "
                             f"{prep[0]['records']['prep']['ours'][0]['wall_s']:.2f} s, torch "
                             f"{prep[0]['records']['prep']['torch'][0]['wall_s']:.2f} s (not a result: "
                             f"{2 * ws} ranks on {os.cpu_count()} cores)")
            except RanksFailed as exc:
                notes.append(f"preparing the {2 * ws}-rank checkpoints failed: {str(exc)[:600]}")
                print(exc, file=sys.stderr)
        per_rank = run_ranks("main_ranks", ws, cfg, timeout_s=a.timeout)
        for r in per_rank:
            notes.extend(n for n in r["notes"] if n not in notes)
        merged = report.merge_ranks(per_rank)
        model_info = per_rank[0].get("model") or {}
        results = report.build_results(merged, total, ws, [r["local_bytes"] for r in per_rank],
                                       model_bytes=model_info.get("bytes"))
        results["tensors"] = len(specs)
        kept = per_rank[0]["kept"]

        if "many" not in a.skip_set and a.many_layers:
            many = model_specs(a.size_bytes, a.many_layers)
            many_total = sum(x.nbytes for x in many)
            print(f"[bench] many-tensor state dict: {many_total / GiB:.3f} GiB in {len(many)} tensors",
                  file=sys.stderr, flush=True)
            cfg_many = dict(cfg, specs=[asdict(x) for x in many], profile_tag=f"-{len(many)}",
                            skip=sorted(set(STEPS) - set(MANY_STEPS)), dir=os.path.join(storage, "many"))
            os.makedirs(cfg_many["dir"], exist_ok=True)
            try:
                pr_many = run_ranks("main_ranks", ws, cfg_many, timeout_s=a.timeout)
                m_merged = report.merge_ranks(pr_many)
                m_merged["limits"] = merged.get("limits", {})
                results["many"] = report.build_results(m_merged, many_total, ws, [r["local_bytes"] for r in pr_many])
                results["many"]["tensors"] = len(many)
                results["many"]["bytes"] = many_total
            except RanksFailed as exc:
                notes.append(f"many-tensor run failed: {str(exc)[:600]}")
                print(exc, file=sys.stderr)
            shutil.rmtree(cfg_many["dir"], ignore_errors=True)

        if "hsdp" not in a.skip_set and a.hsdp_ranks:
            try:
                pr_hsdp = run_ranks("hsdp_ranks", a.hsdp_ranks, cfg, timeout_s=a.timeout)
                results["hsdp"] = report.hsdp_results(pr_hsdp, total, results["limits"])
            except RanksFailed as exc:
                notes.append(f"HSDP run failed: {str(exc)[:600]}")
                print(exc, file=sys.stderr)

        if "offline" in a.skip_set:
            results["offline"] = {"available": False, "note": "skipped (--skip offline)"}
        elif "ours" not in kept:
            results["offline"] = {"available": False, "note": "no checkpoint of ours to transform"}
        else:
            results["offline"] = _subprocess_json(
                ["benchmarks.dcp_offline", kept["ours"], os.path.join(storage, "offline-out"),
                 "--dst-mesh", f"dp={2 * ws}", "--cold", a.cold], timeout=a.timeout)
            if results["offline"].get("error"):
                results["offline"]["note"] = results["offline"]["error"]
            elif results["offline"].get("available"):
                print(f"[bench] offline reshard: {results['offline']['wall_s']:.2f} s, "
                      f"{results['offline']['GiBps']:.2f} GiB/s", file=sys.stderr, flush=True)
        if "planning" in a.skip_set:
            results["planning"] = {"note": "skipped (--skip planning)"}
        else:
            results["planning"] = report.planning_fit(_subprocess_json(
                ["benchmarks.dcp_planning", "--ranks", a.plan_ranks, "--tensors", str(a.plan_tensors),
                 "--budget-s", str(a.plan_budget_s), *(["--in-process"] if a.quick else [])], timeout=a.timeout))
    finally:
        if not a.keep:
            shutil.rmtree(storage, ignore_errors=True)
    machine["uptime_end"] = _run(["uptime"])
    machine["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    reads = results["limits"].get("read_cold", {})
    machine["cold_method"] = reads.get("cold_method") or a.cold
    resident = [x for e in results["scenarios"].values() if isinstance(e, dict)
                for x in e.get("resident_before", []) or []]
    resident += [x for x in reads.get("resident_before", []) if x is not None]
    machine["resident_before_max"] = f"{max(resident):.1%} max" if resident else "n/a"
    doc.update({
        "config": {"size_bytes": total, "tensors": len(specs), "world_size": ws, "reps": a.reps,
                   "warmup": a.warmup, "quick": a.quick, "dir": a.dir, "io_chunk_mib": a.io_chunk_bytes / MiB,
                   "compute_n": a.compute_n, "compute_s": a.compute_s, "ours_save_threads": a.ours_save_threads,
                   "ours_load_threads": a.ours_load_threads, "plan_ranks": a.plan_ranks,
                   "plan_tensors": a.plan_tensors, "skip": sorted(a.skip_set),
                   "model": a.model, "model_params": model_params, "bytecheckpoint": bytecheckpoint,
                   "many_layers": a.many_layers, "hsdp_ranks": a.hsdp_ranks,
                   "specs": [asdict(s) for s in specs]},
        "machine": machine, "raw": merged, "results": results, "elapsed_s": time.monotonic() - t_start,
    })
    return finish(doc, a.out, a.baseline, a.profile)


def finish(doc: dict, out: str, baseline_path: str | None, profile: bool) -> int:
    """Targets, profile summaries, chart, markdown and JSON of a run (``--render-only``
    runs just this on a saved ``latest.json``)."""
    results, notes = doc["results"], doc["notes"]
    baseline = None
    if baseline_path and os.path.exists(baseline_path):
        with open(baseline_path) as f:
            baseline = json.load(f)
        doc["baseline"] = os.path.relpath(baseline_path, ROOT)
    doc["targets"] = report.targets(results, baseline)
    if profile:
        doc["profile"] = {}
        n_many = (results.get("many") or {}).get("tensors")
        names = ["ours-save", "ours-load", "ours-load-s0-s1", "ours-load-s0-s1-noverify", "ours-model-save",
                 "ours-model-load"]
        names += [f"ours-save-{n_many}", f"ours-load-{n_many}", f"ours-load-s0-s1-{n_many}"] if n_many else []
        for name in names:
            prof = report.profile_summary(os.path.join(out, f"profile-{name}.txt"))
            if prof:
                doc["profile"][name] = prof
            elif os.path.exists(os.path.join(out, f"profile-{name}.cprofile.txt")):
                note = f"profile {name}: cProfile (py-spy missing) in {out}/profile-{name}.cprofile.txt"
                if note not in notes:
                    notes.append(note)
    png = report.chart(doc, os.path.join(out, "latest.png"))
    if png is None and "no chart" not in " ".join(notes):
        notes.append("no chart: matplotlib is not installed (pip install -e '.[dev]')")
    md = report.markdown(doc)
    with open(os.path.join(out, "latest.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "cpu_per_gib.md"), "w") as f:  # the headline measure, on its own
        f.write(report.cpu_markdown(doc))
    write_json(os.path.join(out, "latest.json"), doc)
    print(md)
    print(report.targets_text(doc))
    print(f"\n[bench] {doc['elapsed_s']:.0f} s; results in {out}/latest.{{md,json}}"
          + (", latest.png" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
