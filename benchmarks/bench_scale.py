#!/usr/bin/env python
"""Scale benchmark (issue 12): thousands of ranks, through the public API where it can.

Three cases, each printed as a table, written as JSON, and checked against issue 12's
targets (met / not met, with the measured ratio):

1. **Public API** (``--ranks``): T bf16 tensors of ROWS x COLS (default 1000 of 8192 x 4)
   saved from one process (``save(..., no_dist=True)``); ``offline_transform`` to
   ``Shard(0)`` over an N-rank ``dp`` mesh; then, each in a FRESH process (the call is
   timed, not Python's start-up) with the page cache dropped first: ``load`` of ONE tensor
   (``strict=False``), and one rank's shards of all T tensors as rank N/2 of N under torch's
   fake process group (``load(..., no_dist=True)``). Values are checked exactly. Reported:
   wall times, ``.metadata`` size, file count, peak RSS (VmHWM) of each process.
2. **Planning** (``--plan-ranks``): one save's and one load's planning and metadata cost as
   one rank of R simulated ranks x T tensors (``benchmarks/dcp_planning.py``, kind ``dp``).
3. **FSDP+TP planning** (``--strided-ranks``): the same on a 2-D ``(R/tp, tp)`` mesh with
   ``_StridedShard`` placements, to show whether planning grows linearly in R.

Points predicted to exceed ``--budget-s`` are extrapolated from the measured ones and
marked so (this 2-core box cannot run 8192 ranks of today's format in minutes).

Usage::

    python benchmarks/bench_scale.py --quick      # tiny, < 1 min (CI smoke)
    python benchmarks/bench_scale.py              # small: public 64,256 ranks; a few minutes
    python benchmarks/bench_scale.py --ranks 256,1024,4096,8192 --plan-ranks 1024,2048,4096,8192 \\
        --strided-ranks 64,128,256,512,1024,2048,4096,8192 --budget-s 400     # the baseline
    python benchmarks/bench_scale.py --issue47 --cold fadvise   # opt-in: 4,096 / 8,192 / 16,384 / 65,536
        # ranks x 1,000 tensors of 65,536 x 4 (every rank holds a row of each); ~8 GiB of files at
        # 65,536 ranks (checked against free disk first) and tens of minutes on this 2-core box

Issue 47's targets at 65,536 ranks (checked when that point runs): ``offline_transform`` <= 120 s,
``.metadata`` <= 4 MiB, one tensor in a fresh process <= 1 s, one rank's shards <= 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import datetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks import dcp_planning  # noqa: E402
from benchmarks.common import Timer, target_line, write_json  # noqa: E402
from benchmarks.dcp_common import (  # noqa: E402
    MiB,
    TensorSpec,
    check_box,
    chunk_box,
    drop_page_cache,
    human_bytes,
    make_box,
    rss_status,
)

GiB = 1 << 30
PUBLIC_TARGET_RANKS = 4096
ISSUE47_RANKS = 65536
ISSUE47 = {"ranks": "4096,8192,16384,65536", "rows": 65536, "tensors": 1000}
PLAN_TARGET = (8192, 1000)


# ---------------------------------------------------------------------------- workers (fresh processes)


def _specs(tensors: int, rows: int, cols: int) -> list[TensorSpec]:
    return [TensorSpec(f"model.layers.{i}.weight", (rows, cols), "bfloat16", i) for i in range(tensors)]


def _vmhwm() -> int:
    return rss_status().get("VmHWM", 0)


def _base() -> int:
    """RSS once torch and the library are imported: the part of VmHWM that does not scale."""
    import torch  # noqa: F401

    import hyper_parallel.core.distributed_checkpoint  # noqa: F401

    return rss_status().get("VmRSS", 0)


def worker_save_src(path: str, tensors: int, rows: int, cols: int) -> dict:
    import torch  # noqa: F401

    from hyper_parallel.core.distributed_checkpoint import save

    base = _base()
    sd = {s.name: make_box(s, (0, 0), s.shape) for s in _specs(tensors, rows, cols)}
    t = time.perf_counter()
    save(sd, path, no_dist=True)
    return {"wall_s": time.perf_counter() - t, "vmhwm": _vmhwm(), "rss_base": base}


def worker_transform(src: str, dst: str, ranks: int, min_chunk_bytes: int = 0) -> dict:
    from hyper_parallel.core.distributed_checkpoint import Layout, offline_transform

    base = _base()
    strategy = {"*": Layout((ranks,), ("dp",))("dp", "None")}
    with Timer(profile=os.environ.get("HP_BENCH_PROFILE")) as t:
        offline_transform(src, dst, dst_layout=strategy, min_chunk_bytes=min_chunk_bytes or None)
    return {"wall_s": t.seconds, "vmhwm": _vmhwm(), "rss_base": base}


def worker_load_one(path: str, tensors: int, rows: int, cols: int) -> dict:
    import torch

    from hyper_parallel.core.distributed_checkpoint import load

    base = _base()
    spec = _specs(tensors, rows, cols)[tensors // 2]
    target = {spec.name: torch.zeros(spec.shape, dtype=torch.bfloat16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # strict=False warns about the other keys
        with Timer(profile=os.environ.get("HP_BENCH_PROFILE")) as t:
            load(target, path, strict=False)
    return {"wall_s": t.seconds, "vmhwm": _vmhwm(), "rss_base": base,
            "exact": check_box(target[spec.name], spec, (0, 0)), "key": spec.name}


def worker_load_rank(path: str, ranks: int, tensors: int, rows: int, cols: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hyper_parallel.core.distributed_checkpoint import load

    base = _base()
    rank = ranks // 2
    dist.init_process_group("fake", rank=rank, world_size=ranks, store=FakeStore())
    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("dp",))
    off, n = chunk_box(rows, ranks, rank)
    specs = _specs(tensors, rows, cols)
    sd = {s.name: DTensor.from_local(torch.zeros((n, cols), dtype=torch.bfloat16), mesh, [Shard(0)],
                                     run_check=False, shape=torch.Size(s.shape), stride=(cols, 1))
          for s in specs}
    with Timer(profile=os.environ.get("HP_BENCH_PROFILE")) as t:
        load(sd, path, no_dist=True)
    wall = t.seconds
    exact = all(check_box(sd[s.name]._local_tensor, s, (off, 0)) for s in specs)
    dist.destroy_process_group()
    return {"wall_s": wall, "vmhwm": _vmhwm(), "rss_base": base, "exact": exact, "rank": rank, "local_rows": n}


WORKERS = {"save_src": worker_save_src, "transform": worker_transform, "load_one": worker_load_one,
           "load_rank": worker_load_rank}


def _worker_main(name: str, args: list[str]) -> None:
    import resource

    # a load of one tensor of an N-rank checkpoint opens N files (the reader keeps them open)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 17  # 65,536 ranks and room to spare (past the hard limit needs CAP_SYS_RESOURCE; else up to it)
    for limit in ((want, max(hard, want)), (hard, hard)):
        try:
            if soft < limit[0]:
                resource.setrlimit(resource.RLIMIT_NOFILE, limit)
            break
        except (ValueError, OSError):
            continue
    fn = WORKERS[name]
    conv = [int(a) if a.lstrip("-").isdigit() else a for a in args]
    json.dump(fn(*conv), sys.stdout)


def _spawn(name: str, *args: object, timeout_s: float, profile: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench_scale", "--worker", name, *map(str, args)]
    env = os.environ.copy()
    if profile:
        env["HP_BENCH_PROFILE"] = profile
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"{name}: killed after {timeout_s:.0f} s"}
    if proc.returncode:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"error": f"{name} exited {proc.returncode}: {tail}"}
    out = json.loads(proc.stdout)
    out["process_wall_s"] = time.perf_counter() - t
    return out


# ---------------------------------------------------------------------------- the public-API case


def _dir_stats(path: str) -> dict:
    names = os.listdir(path)
    data = sum(os.path.getsize(os.path.join(path, n)) for n in names if n != ".metadata")
    return {"metadata_bytes": os.path.getsize(os.path.join(path, ".metadata")), "files": len(names),
            "data_bytes": data}


VMHWM_KEYS = ("transform_vmhwm", "load_one_vmhwm", "load_rank_vmhwm")
PUBLIC_KEYS = ("transform_s", "load_one_s", "load_rank_s", "metadata_bytes", "files", "transform_vmhwm",
               "load_one_vmhwm", "load_rank_vmhwm")


def _extrapolate_public(measured: list[dict], ranks: int) -> dict:
    last = measured[-1]
    prev = measured[-2] if len(measured) >= 2 else None
    out: dict = {"ranks": ranks, "tensors": last["tensors"], "extrapolated": True, "from": last["ranks"],
                 "slopes": {}}
    for k in PUBLIC_KEYS:
        s = 1.0
        if prev and prev.get(k) and last.get(k) and prev[k] > 0 and last[k] > 0:
            s = max(1.0, math.log(last[k] / prev[k]) / math.log(last["ranks"] / prev["ranks"]))
        if k.endswith("vmhwm") or k == "files":
            s = 1.0  # memory and files: linear at most
        out["slopes"][k] = round(s, 3)
        if last.get(k) is None:
            continue
        base = last.get(k.replace("vmhwm", "rss_base"), 0) if k.endswith("vmhwm") else 0
        out[k] = base + (last[k] - base) * (ranks / last["ranks"]) ** s
    return out


def public_case(a: argparse.Namespace, work: str, notes: list[str]) -> dict:
    src = os.path.join(work, "src")
    shape = (a.rows, a.cols)
    saved = _spawn("save_src", src, a.tensors, a.rows, a.cols, timeout_s=a.timeout)
    if "error" in saved:
        return {"error": saved["error"], "points": []}
    saved.update(_dir_stats(src))
    print(f"[bench] public: {a.tensors} tensors of {shape[0]}x{shape[1]} bf16 saved from one process in "
          f"{saved['wall_s']:.2f} s", file=sys.stderr, flush=True)
    points: list[dict] = []
    measured: list[dict] = []
    wanted = sorted(set(a.ranks_list) | {PUBLIC_TARGET_RANKS}) if a.public_target else sorted(set(a.ranks_list))
    for ranks in wanted:
        if measured and ranks not in a.ranks_list:
            points.append(_extrapolate_public(measured, ranks))
            continue
        if measured:
            pred = _extrapolate_public(measured, ranks)
            total = sum(pred.get(k, 0) for k in ("transform_s", "load_one_s", "load_rank_s"))
            if total > a.budget_s:
                notes.append(f"public {ranks} ranks not run (predicted {total:.0f} s > budget {a.budget_s:.0f} s): "
                             "extrapolated")
                points.append(pred)
                continue
        dst = os.path.join(work, f"dp{ranks}")
        p: dict = {"ranks": ranks, "tensors": a.tensors, "extrapolated": False}
        if measured:  # the files grow with ranks x tensors (headers, indexes): check the disk first
            last = measured[-1]
            need = (last["data_bytes"] + last["metadata_bytes"]) * ranks / last["ranks"]
            free = shutil.disk_usage(work).free
            if free < 1.5 * need:
                notes.append(f"public {ranks} ranks not run: needs about {human_bytes(int(need))} of disk, "
                             f"{human_bytes(free)} free under {a.dir}")
                points.append(_extrapolate_public(measured, ranks))
                continue

        def prof(step: str, n: int = ranks) -> str | None:
            return os.path.join(a.out, f"scale-profile-{step}-{n}.txt") if a.profile else None

        tr = _spawn("transform", src, dst, ranks, a.min_chunk_bytes, timeout_s=a.timeout, profile=prof("transform"))
        if "error" in tr:
            notes.append(f"public {ranks}: {tr['error']}")
            points.append(_extrapolate_public(measured, ranks) if measured else {"ranks": ranks, **tr})
            continue
        p.update({"transform_s": tr["wall_s"], "transform_vmhwm": tr["vmhwm"], "transform_rss_base": tr["rss_base"],
                  **_dir_stats(dst), "load_avg": os.getloadavg()[0]})
        for name, args in (("load_one", (dst, a.tensors, a.rows, a.cols)),
                           ("load_rank", (dst, ranks, a.tensors, a.rows, a.cols))):
            p["cold_method"] = drop_page_cache([dst], a.cold)
            r = _spawn(name, *args, timeout_s=a.timeout, profile=prof(name))
            if "error" in r:
                p[f"{name}_error"] = r["error"]
                notes.append(f"public {ranks}: {r['error']}")
                continue
            p.update({f"{name}_s": r["wall_s"], f"{name}_vmhwm": r["vmhwm"], f"{name}_exact": r["exact"],
                      f"{name}_rss_base": r["rss_base"], f"{name}_process_s": r["process_wall_s"]})
        shutil.rmtree(dst, ignore_errors=True)
        print(f"[bench] public {ranks} ranks: transform {p['transform_s']:.1f} s, one tensor "
              f"{p.get('load_one_s', float('nan')):.2f} s, rank {ranks // 2}'s shards "
              f"{p.get('load_rank_s', float('nan')):.2f} s, .metadata {human_bytes(p['metadata_bytes'])}, "
              f"{p['files']} files", file=sys.stderr, flush=True)
        points.append(p)
        measured.append(p)
    shutil.rmtree(src, ignore_errors=True)
    return {"source": saved, "shape": list(shape), "tensors": a.tensors, "points": points}


# ---------------------------------------------------------------------------- targets and report


def _slope(points: list[dict], key) -> float | None:
    pts = [p for p in points if not p.get("extrapolated") and (key(p) or 0) > 0]
    if len(pts) < 2:
        return None
    xs = [math.log(p["ranks"] * p["tensors"]) for p in pts]
    ys = [math.log(key(p)) for p in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else None


def targets(doc: dict) -> list[dict]:
    out: list[dict] = []

    def add(name: str, value: float | None, op: str, bound: float, unit: str, extrapolated: bool = False,
            extra: str = "") -> None:
        met = None if value is None else (value < bound if op == "<" else value <= bound)
        ratio = None if value is None or not bound else value / bound
        shown = "n/a" if value is None else f"{value:.3g}{unit}"
        out.append({"issue": 12, "target": name, "value": value, "op": op, "bound": bound, "met": met,
                    "ratio": ratio, "extrapolated": extrapolated,
                    "detail": f"{shown} (needs {op} {bound:g}{unit}; {ratio or 0:.2f}x of the bound)"
                              + (" [extrapolated]" if extrapolated else "") + extra})

    plan = doc.get("planning") or {}
    t = plan.get("target") or {}
    ex = bool(t.get("extrapolated"))
    where = f"{t.get('ranks', PLAN_TARGET[0])} x {t.get('tensors', PLAN_TARGET[1])}"
    add(f"{where}: planning + metadata build + serialise < 5 s", t.get("total_s"), "<", 5.0, " s", ex)
    add(f"{where}: parse .metadata < 1 s", t.get("from_json_s"), "<", 1.0, " s", ex)
    mb = t.get("metadata_bytes")
    add(f"{where}: .metadata < 4 MiB", None if mb is None else mb / MiB, "<", 4.0, " MiB", ex)
    hw = t.get("vmhwm")
    add(f"{where}: peak RSS < 1 GiB", None if hw is None else hw / GiB, "<", 1.0, " GiB", ex)
    s = _slope(plan.get("points", []), lambda p: p.get("total_s"))
    add("planning grows linearly in ranks (log-log slope, measured points)", s, "<=", 1.15, "",
        extra=f" over {[p['ranks'] for p in plan.get('points', []) if not p.get('extrapolated')]}")
    st = doc.get("strided") or {}
    s = _slope(st.get("points", []), lambda p: (p.get("total_s") or 0) + (p.get("load_plan_s") or 0))
    add("FSDP+TP (_StridedShard) save+load planning linear in ranks (log-log slope)", s, "<=", 1.15, "",
        extra=f" over {[p['ranks'] for p in st.get('points', []) if not p.get('extrapolated')]}")
    pub = doc.get("public") or {}
    p = next((q for q in pub.get("points", []) if q["ranks"] == PUBLIC_TARGET_RANKS), None) or {}
    ex = bool(p.get("extrapolated"))
    n = PUBLIC_TARGET_RANKS
    add(f"public {n} ranks: offline_transform <= 60 s", p.get("transform_s"), "<=", 60.0, " s", ex)
    add(f"public {n} ranks: one tensor in a fresh process <= 1 s", p.get("load_one_s"), "<=", 1.0, " s", ex)
    add(f"public {n} ranks: one rank's shards of all tensors <= 2 s", p.get("load_rank_s"), "<=", 2.0, " s", ex)
    q47 = next((q for q in pub.get("points", []) if q["ranks"] == ISSUE47_RANKS), None)
    if q47 is not None:  # issue 47: the same four figures at 65,536 ranks
        ex, n = bool(q47.get("extrapolated")), ISSUE47_RANKS
        mb = q47.get("metadata_bytes")
        for name, value, bound, unit in (("offline_transform", q47.get("transform_s"), 120.0, " s"),
                                         (".metadata", None if mb is None else mb / MiB, 4.0, " MiB"),
                                         ("one tensor in a fresh process", q47.get("load_one_s"), 1.0, " s"),
                                         ("one rank's shards of all tensors", q47.get("load_rank_s"), 0.5, " s")):
            add(f"public {n} ranks: {name} <= {bound:g}{unit.strip()}", value, "<=", bound, unit, ex)
            out[-1]["issue"] = 47
    checks = [q.get(k) for q in pub.get("points", []) if not q.get("extrapolated")
              for k in ("load_one_exact", "load_rank_exact") if q.get(k) is not None]  # failed loads: in notes
    out.append({"issue": 12, "target": "public: loaded values exact", "value": None, "op": "==", "bound": None,
                "met": (all(checks) if checks else None), "ratio": None, "extrapolated": False,
                "detail": f"{sum(bool(c) for c in checks)}/{len(checks)} measured loads exact"})
    return out


def _f(v, digits: int = 2, unit: str = "") -> str:
    return "–" if v is None else f"{v:.{digits}f}{unit}"


def markdown(doc: dict) -> str:
    L = [f"# Scale benchmark (issue 12) — {doc['started']}", "", f"`{doc['command']}`", ""]
    m = doc["machine"]
    L.append(f"- machine: {m['nproc']} cores, Linux {m['kernel']}, torch {m['torch']}, hyper_parallel {m['git']}; "
             f"load average at start {m['loadavg_start']}, at end {m['loadavg_end']} (shared machine: noisy)")
    L.append(f"- internals behind `benchmarks/scale_adapter.py`: {doc['adapter']}")
    L.append("- *italic* rows are extrapolated (not run: predicted over the time budget), each metric from "
             "the two largest measured points with its own log-log slope (at least 1)")
    L.append("")
    pub = doc.get("public") or {}
    L.append("## Public API: save from one process, offline_transform to N ranks, loads in fresh processes")
    L.append("")
    if pub.get("error"):
        L.append(f"**error**: {pub['error']}")
    elif pub.get("points"):
        src = pub["source"]
        L.append(f"{pub['tensors']} bf16 tensors of {pub['shape'][0]} x {pub['shape'][1]}; source saved with "
                 f"`save(..., no_dist=True)` in {src['wall_s']:.2f} s (.metadata {human_bytes(src['metadata_bytes'])},"
                 f" {src['files']} files, VmHWM {human_bytes(src['vmhwm'])}). Loads: page cache dropped first; the "
                 "call is timed, not the process start-up; rank = N/2 under torch's fake process group.")
        L.append("")
        L.append("| N ranks | offline_transform s | us per (rank, tensor) | one tensor s | one rank's shards s | "
                 ".metadata | files | VmHWM transform / one / rank | load avg | exact |")
        L.append("|---|---|---|---|---|---|---|---|---|---|")
        for p in pub["points"]:
            it = "*" if p.get("extrapolated") else ""
            ran = [p.get(k) for k in ("load_one_exact", "load_rank_exact") if p.get(k) is not None]
            exact = "–" if p.get("extrapolated") or not ran else (
                ("yes" if all(ran) else "**NO**") + ("" if len(ran) == 2 else " (a load failed: see notes)"))
            per = None if p.get("transform_s") is None else p["transform_s"] / (p["ranks"] * p["tensors"]) * 1e6
            L.append(f"| {it}{p['ranks']}{it} | {it}{_f(p.get('transform_s'), 1)}{it} | {it}{_f(per)}{it} | "
                     f"{it}{_f(p.get('load_one_s'))}{it} | {it}{_f(p.get('load_rank_s'))}{it} | "
                     f"{it}{human_bytes(p.get('metadata_bytes') or 0)}{it} | {it}{int(p.get('files') or 0)}{it} | "
                     f"{it}{' / '.join(human_bytes(p.get(k) or 0) for k in VMHWM_KEYS)}{it} | "
                     f"{_f(p.get('load_avg'), 1)} | {exact} |")
    else:
        L.append("skipped")
    L.append("")
    for key, title in (("planning", "Planning and metadata, 1-D Shard(0) (one rank of R simulated)"),
                       ("strided", "Planning, FSDP+TP 2-D mesh with _StridedShard (one rank of R simulated)")):
        plan = doc.get(key) or {}
        L.append(f"## {title}")
        L.append("")
        if not plan.get("points"):
            L.append(plan.get("note", "skipped"))
            L.append("")
            continue
        L.append("| ranks x tensors | local plan s | exchange decode s | global plan s | build metadata s | "
                 "serialise s | **save total s** | parse s | load plan s | .metadata | VmHWM |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for p in plan["points"]:
            it = "*" if p.get("extrapolated") else ""
            cells = [_f(p.get(k)) for k in ("local_plan_s", "exchange_decode_s", "global_plan_s",
                                            "build_metadata_s", "to_json_s")]
            L.append(f"| {it}{p['ranks']} x {p['tensors']}{it} | " + " | ".join(f"{it}{c}{it}" for c in cells)
                     + f" | {it}**{_f(p.get('total_s'))}**{it} | {it}{_f(p.get('from_json_s'))}{it} | "
                     f"{it}{_f(p.get('load_plan_s'))}{it} | {it}{human_bytes(p.get('metadata_bytes') or 0)}{it} | "
                     f"{it}{human_bytes(p.get('vmhwm') or 0)}{it} |")
        for n in plan.get("notes", []):
            L.append(f"- {n}")
        L.append("")
    L.append("## Targets (issue 12)")
    L.append("")
    for t in doc["targets"]:
        mark = {True: "**met**", False: "**NOT met**", None: "n/a"}[t["met"]]
        L.append(f"- {mark} — {t['target']}: {t['detail']}")
    if doc.get("notes"):
        L.append("")
        L.append("## Notes")
        for n in doc["notes"]:
            L.append(f"- {n}")
    return "\n".join(L) + "\n"


def targets_text(doc: dict) -> str:
    lines = ["Targets (issue 12):"]
    lines += [target_line(t) for t in doc["targets"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes for CI (< 1 min); planning points then share this process")
    ap.add_argument("--ranks", default=None, help="public case: N ranks to transform to (default 64,256)")
    ap.add_argument("--tensors", type=int, default=None, help="public case: tensors (default 1000)")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=4)
    ap.add_argument("--plan-ranks", default=None, help="planning case: simulated ranks (default 256,1024)")
    ap.add_argument("--plan-tensors", type=int, default=None, help="planning case: tensors (default 1000)")
    ap.add_argument("--strided-ranks", default=None, help="FSDP+TP planning: ranks (default 64,128,256)")
    ap.add_argument("--strided-tensors", type=int, default=None, help="FSDP+TP planning: tensors (default 16)")
    ap.add_argument("--tp", type=int, default=8, help="FSDP+TP planning: tensor-parallel size")
    ap.add_argument("--budget-s", type=float, default=None, help="largest predicted time of one point (default 120)")
    ap.add_argument("--skip", default="", help="comma-separated: public,planning,strided")
    ap.add_argument("--cold", choices=("auto", "drop_caches", "fadvise"), default="auto",
                    help="how the page cache is dropped before each public load")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints go (a fresh subfolder)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="writes scale.{md,json}")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for any one process")
    ap.add_argument("--profile", action="store_true",
                    help="public case: cProfile each transform and load (a second, profiled run is not made: the "
                         "timings then include cProfile's overhead); top functions in <out>/scale-profile-*.txt")
    ap.add_argument("--issue47", action="store_true",
                    help="opt-in: the public case at 4096,8192,16384,65536 ranks x 1000 tensors of 65536 x 4 (issue "
                         "47's table), every point run (no budget); planning cases skipped unless asked for")
    ap.add_argument("--min-chunk-bytes", type=int, default=0,
                    help="public case: offline_transform(..., min_chunk_bytes=N): tiny shards stored as chunks of "
                         "several ranks, in fewer files (0: a chunk and a file per rank, the default)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a, rest = ap.parse_known_args(argv)
    if a.worker:
        a.worker_args = rest
        return a
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    q = a.quick
    if a.issue47:
        a.ranks = a.ranks or ISSUE47["ranks"]
        a.tensors = a.tensors or ISSUE47["tensors"]
        a.rows = max(a.rows, ISSUE47["rows"])
        a.budget_s = a.budget_s or 1e9
        if not a.skip:
            a.skip = "planning,strided"
    a.ranks_list = _ints(a.ranks or ("16" if q else "64,256"))
    a.tensors = a.tensors or (20 if q else 1000)
    a.plan_ranks = a.plan_ranks or ("16,32" if q else "256,1024")
    a.plan_tensors = a.plan_tensors or (10 if q else 1000)
    a.strided_ranks = a.strided_ranks or ("16,32" if q else "64,128,256")
    a.strided_tensors = a.strided_tensors or (4 if q else 16)
    a.budget_s = a.budget_s or (20.0 if q else 120.0)
    a.skip_set = {s.strip() for s in a.skip.split(",") if s.strip()}
    a.public_target = True  # the 4096-rank target point: measured if listed, else extrapolated
    if a.skip_set - {"public", "planning", "strided"}:
        ap.error(f"unknown --skip {sorted(a.skip_set - {'public', 'planning', 'strided'})}")
    return a


def _git() -> str:
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "hyper_parallel"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return rev + (" + uncommitted changes in hyper_parallel/" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        _worker_main(a.worker, a.worker_args)
        return 0
    import torch

    from benchmarks import scale_adapter

    t0 = time.monotonic()
    notes: list[str] = []
    doc: dict = {
        "started": datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        "command": "python benchmarks/bench_scale.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": {"nproc": os.cpu_count(), "kernel": platform.release(), "torch": torch.__version__,
                    "git": _git(), "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg())},
        "adapter": scale_adapter.NOTES, "notes": notes,
        "config": {k: getattr(a, k) for k in ("ranks_list", "tensors", "rows", "cols", "plan_ranks", "plan_tensors",
                                              "strided_ranks", "strided_tensors", "tp", "budget_s", "cold",
                                              "profile")},
    }
    print(f"[bench] scale benchmark; load average {doc['machine']['loadavg_start']}", file=sys.stderr, flush=True)
    if a.profile:
        notes.append("--profile: the public case ran under cProfile, so its times include the profiler's overhead; "
                     f"top functions in {a.out}/scale-profile-*.txt")
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="hp-dcp-scale-", dir=a.dir)
    try:
        if "public" not in a.skip_set:
            doc["public"] = public_case(a, work, notes)
        if "planning" not in a.skip_set:
            doc["planning"] = dcp_planning.run(_ints(a.plan_ranks), a.plan_tensors, a.budget_s,
                                               target_ranks=PLAN_TARGET[0], target_tensors=PLAN_TARGET[1],
                                               kind="dp", fresh_process=not a.quick)
        if "strided" not in a.skip_set:
            doc["strided"] = dcp_planning.run(_ints(a.strided_ranks), a.strided_tensors, a.budget_s,
                                              target_ranks=8192, target_tensors=a.strided_tensors,
                                              kind="fsdp_tp", prior_slope=2.0, tp=a.tp,
                                              fresh_process=not a.quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc["machine"]["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    doc["elapsed_s"] = time.monotonic() - t0
    doc["targets"] = targets(doc)
    md = markdown(doc)
    with open(os.path.join(a.out, "scale.md"), "w") as f:
        f.write(md)
    write_json(os.path.join(a.out, "scale.json"), doc)
    print(md)
    print(targets_text(doc))
    print(f"\n[bench] {doc['elapsed_s']:.0f} s; results in {a.out}/scale.{{md,json}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
