#!/usr/bin/env python
"""Saving as Hugging Face safetensors from every rank: ours, our HuggingFaceStorageWriter, torch's.

Issue 32 asks that ``save(sd, storage_writer=HuggingFaceStorageWriter(path, enable_consolidation=True))``
take at most 1.2x our own save of the same state (where torch's writer saves shards, then
reads them all back on rank 0 to write the consolidated files). The state is
``bench_dcp.py``'s model-shaped one (``--layers 36``: 436 tensors; ``--layers 2``: 28 large
ones), each tensor a DTensor over ``--ranks`` gloo ranks, sharded on dim ``--dim`` (0: each
box one run of the file; 1: one run per row). Every library saves ``--reps`` times, each into
a fresh directory, fsync on (every writer's default); reported: the slowest rank per
repetition, best and median. After the last save each output is read back (safetensors or
our loader) and checked exactly against the source.

Scenarios: our ``save`` (our format); our HF writer, consolidated and sharded
(``save_distributed=True``); torch's ``HuggingFaceStorageWriter`` through ``torch.distributed.
checkpoint.save``, consolidated and sharded.

Usage::

    python benchmarks/bench_hf_writer.py                      # 1 GiB, 436 tensors, 2 ranks, 3 reps, on disk
    python benchmarks/bench_hf_writer.py --dim 1 --layers 2   # Shard(1), 28 tensors
    python benchmarks/bench_hf_writer.py --dir /dev/shm       # no disk in the way
    python benchmarks/bench_hf_writer.py --only 'HF writer, consolidated' --reps 5   # the issue's ratio alone

The load average (``/proc/loadavg``) before and after is printed: on a shared machine quote it
with each figure, and prefer the ratios (both saves from the same run).
"""

from __future__ import annotations

import argparse
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

SCENARIOS = ("ours", "HF writer, consolidated", "HF writer, sharded", "torch HF writer, consolidated",
             "torch HF writer, sharded")


def rank_main(rank: int, ws: int, store: str, where: str, layers: int, size: int, reps: int, dim: int,
              only: tuple[str, ...] = SCENARIOS) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter as TorchHF
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from benchmarks.dcp_common import chunk_box, model_specs
    from hyper_parallel.core.distributed_checkpoint import (
        HuggingFaceStorageWriter,
        TorchShardedSafetensorsReader,
        load,
        save,
    )

    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=ws)
    mesh = init_device_mesh("cpu", (ws,))
    specs = model_specs(size, layers)
    sd = {}
    g = torch.Generator().manual_seed(rank)
    for s in specs:
        _, n = chunk_box(s.shape[dim], ws, rank)
        shape = (n, s.shape[1]) if dim == 0 else (s.shape[0], n)
        local = torch.randn(*shape, generator=g).to(getattr(torch, s.dtype))
        sd[s.name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False,
                                        shape=torch.Size(s.shape), stride=(s.shape[1], 1))
    runs = {
        "ours": lambda p: save(sd, p),
        "HF writer, consolidated": lambda p: save(sd, storage_writer=HuggingFaceStorageWriter(
            p, save_distributed=True, enable_consolidation=True)),
        "HF writer, sharded": lambda p: save(sd, storage_writer=HuggingFaceStorageWriter(p, save_distributed=True)),
        "torch HF writer, consolidated": lambda p: tdcp.save(sd, storage_writer=TorchHF(
            p, save_distributed=True, enable_consolidation=True)),
        "torch HF writer, sharded": lambda p: tdcp.save(sd, storage_writer=TorchHF(p, save_distributed=True)),
    }

    def slowest_rank(seconds: float) -> float:
        mine = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return mine.item()

    times: dict[str, list[float]] = {}
    for name, fn in runs.items():
        if name not in only:
            continue
        path = os.path.join(where, name.replace(" ", "_").replace(",", ""))

        def fresh(path: str = path) -> None:  # a fresh directory per repetition (the last one removed, untimed)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()

        times[name] = time_reps(lambda fn=fn, path=path: fn(path), reps, before=fresh, reduce=slowest_rank)
        dist.barrier()
        if rank == 0:  # the last save's output, read back and compared with the whole tensors
            times[f"{name}|correct"] = [float(_correct(name, path, sd, load, load_file, TorchShardedSafetensorsReader))]
        dist.barrier()
    if rank == 0:
        print(json.dumps(times), flush=True)
    dist.destroy_process_group()


def _correct(name, path, sd, load, load_file, sharded_reader) -> bool:
    """Whether the save at ``path`` holds rank 0's shard of every tensor exactly (a spot check:
    the tests check every rank's)."""
    import torch

    if name == "ours":
        got = load(path=path, no_dist=True)
    elif "consolidated" in name:
        got = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                got.update(load_file(os.path.join(path, f)))
    else:
        got = load(storage_reader=sharded_reader(path), no_dist=True)
    for k, v in sd.items():
        local = v.to_local()
        box = tuple(slice(0, n) for n in local.shape)  # rank 0's box starts at 0 in every dim
        if k not in got or not torch.equal(got[k][box], local):
            return False
    return True


def _loadavg() -> str:
    """The 1-, 5- and 15-minute load averages (empty where /proc is not there)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=36, help="36: 436 tensors; 2: 28")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=0, choices=(0, 1), help="the dim every tensor is sharded on")
    ap.add_argument("--dir", default=None, help="where to save (default: a temporary directory on disk)")
    ap.add_argument("--only", action="append", choices=SCENARIOS[1:], default=[],
                    help="a scenario to run besides 'ours' (repeat for more); default: all")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    a = ap.parse_args()
    only = tuple(n for n in SCENARIOS if n == "ours" or not a.only or n in a.only)
    if a.rank is not None:
        rank_main(a.rank, a.ranks, a.store, a.dir, a.layers, a.size_mib << 20, a.reps, a.dim, only)
        return
    load_before = _loadavg()
    where = tempfile.mkdtemp(prefix="bench_hf_writer_", dir=a.dir)
    try:
        store = os.path.join(where, "store")
        args = [sys.executable, os.path.abspath(__file__), "--layers", str(a.layers), "--ranks", str(a.ranks),
                "--reps", str(a.reps), "--size-mib", str(a.size_mib), "--dim", str(a.dim), "--dir", where,
                "--store", store, *(f"--only={n}" for n in a.only)]
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        procs = [subprocess.Popen([*args, "--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env)
                 for r in range(a.ranks)]
        outs = [p.communicate(timeout=3600)[0] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit(f"a rank failed: return codes {[p.returncode for p in procs]}")
    finally:
        shutil.rmtree(where, ignore_errors=True)
    times = json.loads(outs[0].strip().splitlines()[-1])
    n = 28 if a.layers == 2 else 12 * a.layers + 4
    print(f"{a.size_mib} MiB global in {n} tensors, Shard({a.dim}) over {a.ranks} ranks, {a.reps} reps, fsync on, "
          f"in {a.dir or tempfile.gettempdir()}; seconds of the slowest rank: best / median; load average "
          f"{load_before} before, {_loadavg()} after")
    ours = statistics.median(times["ours"])
    print("\n".join(table_head("save", "best / median (s)", "median / ours", "read back exact")))
    for name in only:
        t = times[name]
        print(table_row(name, f"{min(t):.3f} / {statistics.median(t):.3f}", f"{statistics.median(t) / ours:.2f}x",
                        bool(times[f"{name}|correct"][0])))


if __name__ == "__main__":
    main()
