"""Planning time and metadata size for a simulated job of R ranks x T tensors (no processes).

Every rank's local save plan is built as ``StandardPlanner.create_local_save_plan`` would
build it for T 2-D bf16 tensors, each ``Shard(0)`` over a 1-D mesh of R ranks; then the
work every rank (or the coordinator) does once the plans are exchanged is timed:

- ``global_plan_s``: ``StandardPlanner.create_global_save_plan(plans)`` (every rank runs it);
- ``build_metadata_s``: ``saver.build_metadata`` over every rank's write results (coordinator);
- ``to_json_s``: ``Metadata.to_json`` (coordinator); ``metadata_bytes``: its size;
- ``total_s`` = the three above: the planning + metadata cost of one save;
- ``from_json_s`` (reported, not in the total): parsing that metadata, done at every load;
- ``exchange_decode_s`` (reported, not in the total): unpickling the R local plans that the
  plan exchange hands every rank (measured on a sample, scaled to R).

The local plans share one ``entries`` dict (in a real exchange every plan carries its own
copy; the work done on them is the same). Points run in increasing size; a point whose time
or memory, predicted linearly from the previous one, exceeds the budget is not run but
extrapolated from the largest measured point, and marked so.

Run: ``python -m benchmarks.dcp_planning --ranks 1024,2048,4096,8192 --tensors 1000`` (JSON
on stdout).
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import sys
import time

from benchmarks.dcp_common import mem_available, reset_peak_rss, rss_status


def simulate(ranks: int, tensors: int, hidden: int = 8192) -> dict:
    """One save's planning and metadata work at ``ranks`` x ``tensors``, as format v2 does it.

    Every rank's structure is the same (one digest), so the exchange carries one structure;
    every rank computes the global plan (entries and stores: O(tensors)) and its own writes;
    the coordinator builds ``.metadata`` from one file record per rank.
    """
    from hyper_parallel.core.distributed_checkpoint import metadata as md
    from hyper_parallel.core.distributed_checkpoint.planner import EntrySpec, SavePlan
    from hyper_parallel.core.distributed_checkpoint.saver import WriteResult, build_metadata
    from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardPlanner

    h = hidden
    shapes = [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)]
    layout = {"mesh_shape": [ranks], "mesh_dim_names": ["dp"], "placements": ["S(0)"]}
    keys = [f"model.layers.{i // 4}.w{i % 4}" for i in range(tensors)]

    t = time.perf_counter()
    entries = {k: EntrySpec("tensor", ("model", "layers", str(i // 4), f"w{i % 4}"), "bfloat16",
                            shapes[i % 4], dict(layout)) for i, k in enumerate(keys)}
    local = SavePlan(entries, [], [])
    local_s = time.perf_counter() - t

    blob = pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL)  # the one structure every rank receives
    t = time.perf_counter()
    pickle.loads(blob)
    decode_s = time.perf_counter() - t
    plan_bytes = len(blob) + 96 * ranks  # plus a digest, a save id and cache flags per rank

    planner = StandardPlanner()
    t = time.perf_counter()
    global_plans = planner.create_global_save_plan([local] * ranks)
    mine = global_plans[ranks // 2]  # each rank works out its own writes
    global_s = time.perf_counter() - t
    assert len({i.key for i in mine.items}) == tensors  # large chunks may be written as several column bands

    results = []
    for r in range(ranks):  # what each rank's write_plan reports to the coordinator
        wr = WriteResult()
        wr.files.append(md.FileRecord(f"data-r{r:05d}-0-0123456789abcdef.safetensors", "", r, 1 << 20, 24_000,
                                      0x1234ABCD, (1 << 20) + 24_000))
        results.append(wr)
    t = time.perf_counter()
    meta = build_metadata(mine.entries, results, "0123456789abcdef", ranks, {})
    build_s = time.perf_counter() - t
    del results, global_plans
    gc.collect()
    t = time.perf_counter()
    raw = meta.to_json()
    json_s = time.perf_counter() - t
    del meta
    gc.collect()
    t = time.perf_counter()
    md.Metadata.from_json(raw)
    parse_s = time.perf_counter() - t
    return {
        "ranks": ranks, "tensors": tensors, "chunks": ranks * tensors,
        "global_plan_s": global_s, "build_metadata_s": build_s, "to_json_s": json_s,
        "total_s": global_s + build_s + json_s, "metadata_bytes": len(raw),
        "from_json_s": parse_s, "exchange_decode_s": decode_s, "plan_exchange_bytes": plan_bytes,
        "local_plans_s": local_s, "extrapolated": False,
    }


def run(ranks_list: list[int], tensors: int, budget_s: float, mem_fraction: float,
        target_ranks: int, target_tensors: int) -> dict:
    import hyper_parallel.core.distributed_checkpoint  # noqa: F401  (imports are not part of a point's memory)

    points: list[dict] = []
    notes: list[str] = []
    last: dict | None = None
    wanted = sorted(set(ranks_list) | {target_ranks}) if tensors == target_tensors else sorted(set(ranks_list))
    for ranks in wanted:
        if last is not None:
            scale = ranks * tensors / (last["ranks"] * last["tensors"])
            t_pred = last["point_wall_s"] * scale
            m_pred = last["peak_rss_above_start"] * scale
            avail = mem_available()
            if t_pred > budget_s or m_pred > mem_fraction * avail:
                why = (f"predicted {t_pred:.0f} s > budget {budget_s:.0f} s" if t_pred > budget_s else
                       f"predicted {m_pred / 2**30:.1f} GiB > {mem_fraction:.0%} of {avail / 2**30:.1f} GiB available")
                notes.append(f"{ranks} ranks x {tensors} tensors not run ({why}): extrapolated")
                points.append(extrapolate(last, ranks, tensors))
                continue
        gc.collect()
        reset_peak_rss()
        start = rss_status().get("VmRSS", 0)
        t = time.perf_counter()
        point = simulate(ranks, tensors)
        point["point_wall_s"] = time.perf_counter() - t
        point["peak_rss_above_start"] = max(0, rss_status().get("VmHWM", 0) - start)
        print(f"[bench] planning {ranks} ranks x {tensors} tensors: {point['total_s']:.2f} s, "
              f"metadata {point['metadata_bytes'] / 2**20:.1f} MiB", file=sys.stderr, flush=True)
        points.append(point)
        last = point
        gc.collect()
    target = next((p for p in points if p["ranks"] == target_ranks and p["tensors"] == target_tensors), None)
    if target is None and last is not None:
        target = extrapolate(last, target_ranks, target_tensors)
        notes.append(f"target {target_ranks} x {target_tensors} extrapolated from "
                     f"{last['ranks']} x {last['tensors']}")
    return {"points": points, "target": target, "notes": notes}


def extrapolate(point: dict, ranks: int, tensors: int) -> dict:
    """A point scaled linearly in ranks x tensors from a measured one (marked extrapolated)."""
    scale = ranks * tensors / (point["ranks"] * point["tensors"])
    out = {"ranks": ranks, "tensors": tensors, "chunks": ranks * tensors, "extrapolated": True,
           "from": [point["ranks"], point["tensors"]]}
    for k in ("global_plan_s", "build_metadata_s", "to_json_s", "total_s", "from_json_s",
              "exchange_decode_s", "local_plans_s", "point_wall_s", "peak_rss_above_start"):
        if k in point:
            out[k] = point[k] * scale
    out["metadata_bytes"] = int(point["metadata_bytes"] * scale)
    out["plan_exchange_bytes"] = int(point.get("plan_exchange_bytes", 0) * scale)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1024,2048,4096,8192")
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--budget-s", type=float, default=300.0, help="largest predicted time of one point")
    ap.add_argument("--mem-fraction", type=float, default=0.5, help="of MemAvailable, for one point")
    ap.add_argument("--target-ranks", type=int, default=8192)
    ap.add_argument("--target-tensors", type=int, default=1000)
    a = ap.parse_args(argv)
    out = run([int(x) for x in a.ranks.split(",") if x], a.tensors, a.budget_s, a.mem_fraction,
              a.target_ranks, a.target_tensors)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
