"""Planning and metadata cost of one save and load, as one rank of R simulated ranks x T tensors.

Each point runs in a fresh process that joins torch's fake process group as rank R/2 of R
(collectives are no-ops), builds that rank's DTensors (local memory never touched), and
times each step of a save's planning and a load's planning through the functions of
``benchmarks/scale_adapter.py`` (the only place that knows the library's internals):

- ``local_plan_s``: the rank plans its own shards;
- ``exchange_decode_s``: decoding what the plan exchange gathered from all R ranks
  (measured on a sample of ranks, scaled to R);
- ``global_plan_s``: the global plan every rank derives;
- ``build_metadata_s``, ``to_json_s``: the coordinator's metadata build and encoding;
- ``total_s`` = the five above: the planning + metadata cost of a first save (later saves
  of an unchanged state dict skip the exchange and the global plan: plan cache);
- ``from_json_s``: parsing ``.metadata`` (every rank, at every load); ``metadata_bytes``;
- ``load_plan_s``: the rank plans its reads for a load in the same layout;
- ``vmhwm``: the process's peak RSS (VmHWM); ``peak_rss_above_start``: above its RSS once
  torch was imported and the DTensors built.

Kinds of state dict:

- ``dp``: T 2-D bf16 tensors (shapes of a hidden size 8192 model), each ``Shard(0)`` over a
  1-D mesh of R ranks (issue 12's 8192 x 1000 case);
- ``fsdp_tp``: FSDP + TP on a 2-D mesh ``(R / tp, tp)``: half the tensors column-wise
  (``[_StridedShard(0, split_factor=tp), Shard(0)]``, what ``fully_shard`` over a
  ``ColwiseParallel`` weight gives), half row-wise (``[Shard(0), Shard(1)]``).

Points run in increasing R. A point whose time or memory, predicted from the measured ones
(log-log slope of the last two, at least 1; ``prior_slope`` before that), exceeds the
budget is not run: it is extrapolated from the largest measured point, metric by metric
with each metric's own slope, and marked ``extrapolated``.

Run: ``python -m benchmarks.dcp_planning --kind dp --ranks 1024,2048,4096,8192 --tensors 1000``
(JSON on stdout); one point: ``python -m benchmarks.dcp_planning --point --kind fsdp_tp --ranks 256``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import Timer  # noqa: E402
from benchmarks.dcp_common import chunk_box, mem_available, reset_peak_rss, rss_status  # noqa: E402

TIMED = ("local_plan_s", "exchange_decode_s", "global_plan_s", "build_metadata_s", "to_json_s", "from_json_s",
         "load_plan_s")
SCALED = (*TIMED, "total_s", "point_wall_s", "peak_rss_above_start", "vmhwm", "metadata_bytes",
          "plan_exchange_bytes", "local_plans_sim_s")


# ---------------------------------------------------------------------------- one point


def _state(kind: str, ranks: int, tensors: int, rank: int, hidden: int, tp: int):
    """This rank's DTensors, and every rank's boxes per key (for the simulated exchange)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    sd: dict = {}
    boxes: dict[str, list] = {}  # key -> per-rank (offsets, sizes), shared between keys of one kind
    if kind == "dp":
        mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("dp",))
        h = hidden
        shapes = [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)]
        per_shape = {}
        for s in shapes:
            per_shape[s] = []
            for r in range(ranks):
                off, n = chunk_box(s[0], ranks, r)
                per_shape[s].append(((off, 0), (n, s[1])))
        for i in range(tensors):
            s = shapes[i % 4]
            key = f"model.layers.{i // 4}.w{i % 4}"
            (_, _), (n, cols) = per_shape[s][rank]
            local = torch.empty((n, cols), dtype=torch.bfloat16)
            sd[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(s),
                                         stride=(s[1], 1))
            boxes[key] = per_shape[s]
        return sd, boxes
    if kind != "fsdp_tp":
        raise ValueError(f"unknown kind {kind!r}; expected dp or fsdp_tp")
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    if ranks % tp or ranks < tp:
        raise ValueError(f"fsdp_tp needs ranks divisible by tp={tp}, got {ranks}")
    dp = ranks // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    rows = max(8192, ranks)
    cols = 8 * tp
    kinds = {"col": [_StridedShard(0, split_factor=tp), Shard(0)], "row": [Shard(0), Shard(1)]}
    per_kind = {}
    for name, placements in kinds.items():
        per_kind[name] = []
        for r in range(ranks):
            sizes, offsets = _compute_local_shape_and_global_offset((rows, cols), (dp, tp), [r // tp, r % tp],
                                                                     placements)
            per_kind[name].append((tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)))
    for i in range(tensors):
        name = "col" if i % 2 == 0 else "row"
        key = f"model.layers.{i // 2}.{'wq' if name == 'col' else 'wo'}.weight"
        _, sizes = per_kind[name][rank]
        local = torch.empty(sizes, dtype=torch.bfloat16)
        sd[key] = DTensor.from_local(local, mesh, kinds[name], run_check=False, shape=torch.Size((rows, cols)),
                                     stride=(cols, 1))
        boxes[key] = per_kind[name]
    return sd, boxes


def simulate(kind: str, ranks: int, tensors: int, hidden: int = 8192, tp: int = 8, sample: int = 256) -> dict:
    """Join the fake process group as rank ranks/2 and time one save's and load's planning."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks import scale_adapter as ad

    rank = ranks // 2
    dist.init_process_group("fake", rank=rank, world_size=ranks, store=FakeStore())
    with Timer() as setup:
        sd, boxes = _state(kind, ranks, tensors, rank, hidden, tp)
        keys = list(sd)
        ad.rank_save_plan({keys[0]: sd[keys[0]]})  # warm-up: torch's lazy imports and caches, not scale
    setup_s = setup.wall_s
    gc.collect()
    start_rss = rss_status().get("VmRSS", 0)
    t_point = time.perf_counter()
    out: dict = {"kind": kind, "ranks": ranks, "tensors": tensors, "chunks": ranks * tensors, "rank": rank,
                 "setup_s": setup_s, "extrapolated": False}

    with Timer() as t:
        local = ad.rank_save_plan(sd)
    out["local_plan_s"] = t.wall_s

    with Timer() as t:
        plans = ad.all_rank_plans(local, ranks, lambda r: ((k, boxes[k][r]) for k in keys))
    out["local_plans_sim_s"] = t.wall_s
    picked = plans[:: max(1, ranks // sample)]
    blobs = ad.encode_exchange(picked)
    with Timer() as t:
        ad.decode_exchange(blobs)
    out["exchange_decode_s"] = t.wall_s * ranks / len(picked)
    out["plan_exchange_bytes"] = sum(map(len, blobs)) * ranks // len(picked)
    del blobs, picked

    with Timer() as t:
        global_plans = ad.global_save_plan(plans)
    out["global_plan_s"] = t.wall_s
    del plans
    gc.collect()

    results = ad.simulated_writes(global_plans)
    with Timer() as t:
        meta = ad.build_metadata(global_plans, results, ranks)
    out["build_metadata_s"] = t.wall_s
    del results, global_plans
    gc.collect()

    with Timer() as t:
        raw = ad.serialise_metadata(meta)
    out["to_json_s"] = t.wall_s
    out["metadata_bytes"] = len(raw)
    del meta
    gc.collect()

    with Timer() as t:
        meta = ad.parse_metadata(raw)
    out["from_json_s"] = t.wall_s
    del raw
    gc.collect()

    with Timer() as t:
        out["load_reads"] = ad.rank_load_plan(sd, meta, rank)
    out["load_plan_s"] = t.wall_s
    out["point_wall_s"] = time.perf_counter() - t_point
    out["total_s"] = sum(out[k] for k in ("local_plan_s", "exchange_decode_s", "global_plan_s",
                                          "build_metadata_s", "to_json_s"))
    st = rss_status()
    out["vmhwm"] = st.get("VmHWM", 0)
    out["rss_start"] = start_rss
    out["peak_rss_above_start"] = max(0, st.get("VmHWM", 0) - start_rss)
    dist.destroy_process_group()
    return out


# ---------------------------------------------------------------------------- many points


def _slope(a: dict, b: dict, key: str) -> float | None:
    """log-log slope of ``key`` against ranks x tensors between two points."""
    x0, x1 = a["ranks"] * a["tensors"], b["ranks"] * b["tensors"]
    y0, y1 = a.get(key), b.get(key)
    if not y0 or not y1 or x0 == x1 or y0 <= 0 or y1 <= 0:
        return None
    return math.log(y1 / y0) / math.log(x1 / x0)


def extrapolate(measured: list[dict], ranks: int, tensors: int, prior_slope: float = 1.0) -> dict:
    """A point scaled from the largest measured one, each metric with its own log-log slope
    over the two largest measured points (at least 1: nothing here shrinks per chunk)."""
    last = measured[-1]
    prev = measured[-2] if len(measured) >= 2 else None
    scale = ranks * tensors / (last["ranks"] * last["tensors"])
    out = {"kind": last.get("kind"), "ranks": ranks, "tensors": tensors, "chunks": ranks * tensors,
           "extrapolated": True, "from": [last["ranks"], last["tensors"]], "slopes": {}}
    for k in SCALED:
        if k not in last:
            continue
        s = _slope(prev, last, k) if prev else None
        s = prior_slope if s is None else max(1.0, s)
        out["slopes"][k] = round(s, 3)
        out[k] = last[k] * scale ** s
    if "rss_start" in last and "peak_rss_above_start" in out:  # a fixed base (torch, the DTensors) does not scale
        out["vmhwm"] = last["rss_start"] + out["peak_rss_above_start"]
        out["slopes"]["vmhwm"] = out["slopes"]["peak_rss_above_start"]
    for k in ("metadata_bytes", "plan_exchange_bytes", "vmhwm", "peak_rss_above_start"):
        if k in out:
            out[k] = int(out[k])
    return out


def run_point(kind: str, ranks: int, tensors: int, timeout_s: float, fresh_process: bool = True, **kw) -> dict:
    """One point in a fresh process (so VmHWM is the point's own), or in this one (cheaper:
    for smoke tests; VmHWM is then reset before the point, but memory the earlier points
    left behind still counts)."""
    if not fresh_process:
        reset_peak_rss()
        return simulate(kind, ranks, tensors, **kw)
    cmd = [sys.executable, "-m", "benchmarks.dcp_planning", "--point", "--kind", kind, "--ranks", str(ranks),
           "--tensors", str(tensors)]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
    try:
        with Timer() as t:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"{kind} {ranks} x {tensors}: killed after {timeout_s:.0f} s"}
    if proc.returncode:
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"error": f"{kind} {ranks} x {tensors}: exit {proc.returncode}: {' | '.join(tail)}"}
    out = json.loads(proc.stdout)
    out["process_wall_s"] = t.wall_s
    return out


def run(ranks_list: list[int], tensors: int, budget_s: float, mem_fraction: float = 0.5,
        target_ranks: int = 8192, target_tensors: int = 1000, kind: str = "dp", prior_slope: float = 1.0,
        fresh_process: bool = True, **kw) -> dict:
    """Points in increasing ranks; those predicted over budget (time or memory) are
    extrapolated; the target point is added (extrapolated) when it was not measured."""
    points: list[dict] = []
    measured: list[dict] = []
    notes: list[str] = []
    wanted = sorted(set(ranks_list) | ({target_ranks} if tensors == target_tensors else set()))
    for ranks in wanted:
        if measured:
            last = measured[-1]
            s = _slope(measured[-2], last, "point_wall_s") if len(measured) >= 2 else None
            s = prior_slope if s is None else max(1.0, s)
            scale = ranks * tensors / (last["ranks"] * last["tensors"])
            t_pred = last["point_wall_s"] * scale ** s
            m_pred = last["peak_rss_above_start"] * scale
            avail = mem_available()
            if t_pred > budget_s or m_pred > mem_fraction * avail:
                why = (f"predicted {t_pred:.0f} s > budget {budget_s:.0f} s" if t_pred > budget_s else
                       f"predicted {m_pred / 2**30:.1f} GiB > {mem_fraction:.0%} of {avail / 2**30:.1f} GiB "
                       "available")
                notes.append(f"{kind}: {ranks} ranks x {tensors} tensors not run ({why}): extrapolated")
                points.append(extrapolate(measured, ranks, tensors, prior_slope))
                continue
        point = run_point(kind, ranks, tensors, timeout_s=max(600.0, 4 * budget_s), fresh_process=fresh_process,
                          **kw)
        if "error" in point:
            notes.append(point["error"] + " (extrapolated instead)")
            if measured:
                points.append(extrapolate(measured, ranks, tensors, prior_slope))
            continue
        print(f"[bench] planning {kind} {ranks} ranks x {tensors} tensors: total {point['total_s']:.2f} s, "
              f"parse {point['from_json_s']:.2f} s, load plan {point['load_plan_s']:.2f} s, metadata "
              f"{point['metadata_bytes'] / 2**20:.1f} MiB, VmHWM {point['vmhwm'] / 2**30:.2f} GiB",
              file=sys.stderr, flush=True)
        points.append(point)
        measured.append(point)
    target = next((p for p in points if p["ranks"] == target_ranks and p["tensors"] == target_tensors), None)
    if target is None and measured:
        target = extrapolate(measured, target_ranks, target_tensors, prior_slope)
        notes.append(f"{kind}: target {target_ranks} x {target_tensors} extrapolated from "
                     f"{measured[-1]['ranks']} x {measured[-1]['tensors']}")
    return {"kind": kind, "points": points, "target": target, "notes": notes}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("dp", "fsdp_tp"), default="dp")
    ap.add_argument("--ranks", default="1024,2048,4096,8192")
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--hidden", type=int, default=8192, help="dp: hidden size of the tensor shapes")
    ap.add_argument("--tp", type=int, default=8, help="fsdp_tp: tensor-parallel size (mesh dim 1)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="largest predicted time of one point")
    ap.add_argument("--mem-fraction", type=float, default=0.5, help="of MemAvailable, for one point")
    ap.add_argument("--target-ranks", type=int, default=8192)
    ap.add_argument("--target-tensors", type=int, default=1000)
    ap.add_argument("--prior-slope", type=float, default=1.0, help="growth assumed before two points exist")
    ap.add_argument("--point", action="store_true", help="run one point (--ranks N) in this process")
    ap.add_argument("--in-process", action="store_true", help="run every point in this process (smoke tests)")
    a = ap.parse_args(argv)
    extra = {"hidden": a.hidden} if a.kind == "dp" else {"tp": a.tp}
    if a.point:
        json.dump(simulate(a.kind, int(a.ranks), a.tensors, **extra), sys.stdout)
        return
    out = run([int(x) for x in a.ranks.split(",") if x], a.tensors, a.budget_s, a.mem_fraction,
              a.target_ranks, a.target_tensors, kind=a.kind, prior_slope=a.prior_slope,
              fresh_process=not a.in_process, **extra)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
