#!/usr/bin/env python
"""Save and load with no device in the way: the CPU side of a checkpoint, ours vs torch DCP.

``bench_dcp.py`` measures against a disk, whose speed swings between runs here. This one
saves to and loads from memory (``/dev/shm`` by default, page cache warm), so what it times
is what the libraries do per byte and per tensor: planning, checksums, copies between
scratch memory and tensors, threads. The state is ``bench_dcp.py``'s model-shaped one
(``--layers 36``: 436 tensors; ``--layers 2``: 28 large ones), 1 GiB global, each tensor a
``Shard(0)`` DTensor over ``--ranks`` gloo ranks. Every rank saves ``--reps`` times (fsync
off: there is no disk), then loads as many times into the same targets; reported: the
slowest rank per repetition, best and median. The loaded values are checked exactly.

Usage::

    python benchmarks/bench_warm.py                  # 436 tensors, 2 ranks, 5 reps
    python benchmarks/bench_warm.py --layers 2       # 28 tensors
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import table_head, table_row, time_reps  # noqa: E402


def rank_main(rank: int, ws: int, store: str, where: str, layers: int, size: int, reps: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from benchmarks.dcp_common import chunk_box, model_specs
    from hyper_parallel.core.distributed_checkpoint import load, save

    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=ws)
    mesh = init_device_mesh("cpu", (ws,))
    specs = model_specs(size, layers)

    def state(fill: bool) -> dict:
        sd = {}
        g = torch.Generator().manual_seed(rank)
        for s in specs:
            _, n = chunk_box(s.shape[0], ws, rank)
            local = (torch.randn(n, s.shape[1], generator=g).to(getattr(torch, s.dtype)) if fill
                     else torch.zeros(n, s.shape[1], dtype=getattr(torch, s.dtype)))
            sd[s.name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                            shape=torch.Size(s.shape), stride=(s.shape[1], 1))
        return sd

    source, target = state(True), state(False)
    ops = {
        "ours": (lambda p: save(source, p, sync_files=False), lambda p: load(target, p)),
        "torch DCP": (lambda p: tdcp.save(source, checkpoint_id=p), lambda p: tdcp.load(target, checkpoint_id=p)),
    }
    def slowest_rank(seconds: float) -> float:
        mine = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return mine.item()

    times: dict[str, list[float]] = {}
    for lib, (do_save, do_load) in ops.items():
        path = os.path.join(where, lib.replace(" ", "_"))
        for kind, fn in (("save", do_save), ("load", do_load)):
            times[f"{lib}|{kind}"] = time_reps(functools.partial(fn, path), reps, before=dist.barrier,
                                               reduce=slowest_rank)
        ok = all(torch.equal(target[k].to_local(), source[k].to_local()) for k in source)
        for t in target.values():
            t.to_local().zero_()
        times[f"{lib}|correct"] = [float(ok)]
    dist.barrier()
    if rank == 0:
        print(json.dumps(times), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=36, help="36: 436 tensors; 2: 28")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank is not None:
        rank_main(a.rank, a.ranks, a.store, a.dir, a.layers, a.size_mib << 20, a.reps)
        return
    where = tempfile.mkdtemp(prefix="bench_warm_", dir=a.dir)
    try:
        store = os.path.join(where, "store")
        args = [sys.executable, os.path.abspath(__file__), "--layers", str(a.layers), "--ranks", str(a.ranks),
                "--reps", str(a.reps), "--size-mib", str(a.size_mib), "--dir", where, "--store", store]
        procs = [subprocess.Popen([*args, "--rank", str(r)], stdout=subprocess.PIPE, text=True)
                 for r in range(a.ranks)]
        outs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit(f"a rank failed: return codes {[p.returncode for p in procs]}")
    finally:
        shutil.rmtree(where, ignore_errors=True)
    times = json.loads(outs[0].strip().splitlines()[-1])
    n = 28 if a.layers == 2 else 12 * a.layers + 4
    print(f"{a.size_mib} MiB global in {n} tensors, {a.ranks} ranks, {a.reps} reps, in {a.dir} (warm); "
          "seconds of the slowest rank: best / median")
    print("\n".join(table_head("operation", "ours", "torch DCP", "torch / ours (median)")))
    for kind in ("save", "load"):
        ours, tor = times[f"ours|{kind}"], times[f"torch DCP|{kind}"]
        print(table_row(kind, f"{min(ours):.3f} / {statistics.median(ours):.3f}",
                        f"{min(tor):.3f} / {statistics.median(tor):.3f}",
                        f"{statistics.median(tor) / statistics.median(ours):.2f}x"))
    print(f"values correct: ours {bool(times['ours|correct'][0])}, torch DCP {bool(times['torch DCP|correct'][0])}")


if __name__ == "__main__":
    main()
