"""Offline transform throughput and peak memory, in a process of its own (no process group).

Runs ``hyper_parallel.core.distributed_checkpoint.reshard.reshard(src, dst, dst_mesh=...)``
on a checkpoint whose files were just made cold, and reports the wall time, the bytes of
tensor data it rewrote, and the process's peak RSS during the transform (VmHWM reset just
before it) next to its RSS before. Prints one JSON object; ``{"available": false, ...}``
when the library has no ``reshard`` yet.

Run: ``python -m benchmarks.dcp_offline SRC DST --dst-mesh dp=4``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.dcp_common import drop_page_cache, files_under, io_counters, reset_peak_rss, rss_status


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--dst-mesh", default="dp=4", help="NAME=SIZE[,NAME=SIZE...]")
    ap.add_argument("--cold", default="auto")
    ap.add_argument("--max-memory", type=int, default=None)
    a = ap.parse_args(argv)
    out: dict = {"available": False}
    try:
        from hyper_parallel.core.distributed_checkpoint.reshard import reshard
    except ImportError as exc:
        out["note"] = f"hyper_parallel.core.distributed_checkpoint.reshard.reshard is missing ({exc})"
        json.dump(out, sys.stdout)
        return
    import hyper_parallel.core.distributed_checkpoint as hp

    out["offline_transform_exists"] = hasattr(hp, "offline_transform")
    dst_mesh = {k: int(v) for k, v in (kv.split("=") for kv in a.dst_mesh.split(","))}
    src_bytes = sum(os.path.getsize(f) for f in files_under([a.src]) if not f.endswith(".metadata"))
    kw = {"max_memory": a.max_memory} if a.max_memory else {}
    out["cold_method"] = drop_page_cache([a.src], a.cold)
    rss0 = rss_status()
    reset_peak_rss()
    io0 = io_counters()
    t0 = time.monotonic()
    reshard(a.src, a.dst, dst_mesh=dst_mesh, sync_files=True, **kw)
    wall = time.monotonic() - t0
    io1 = io_counters()
    rss1 = rss_status()
    dst_bytes = sum(os.path.getsize(f) for f in files_under([a.dst]) if not f.endswith(".metadata"))
    out.update({
        "available": True, "function": "reshard.reshard", "dst_mesh": dst_mesh, "wall_s": wall,
        "src_bytes": src_bytes, "dst_bytes": dst_bytes, "GiBps": src_bytes / wall / 2**30,
        "rss_before": rss0.get("VmRSS", 0), "peak_rss": rss1.get("VmHWM", 0),
        "peak_above_before": max(0, rss1.get("VmHWM", 0) - rss0.get("VmRSS", 0)),
        "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
        "max_memory": a.max_memory,
    })
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
