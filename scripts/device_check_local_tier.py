"""Device check of the CheckpointManager's local tier with accelerator state dicts.

Needs a CUDA machine (falls back to CPU tensors elsewhere, which checks only the script):
(a) one process: 1 GiB of CUDA tensors plus CPU/numpy/bytes/plain values saved locally four
times (pinned staging buffers, device-to-host snapshot), then loaded into CUDA targets in
place, bit-exact; (b) two gloo processes as two nodes sharing the GPU: local saves with
replication, node 1's directory wiped, recovery fetches its copy from node 0 into CUDA
targets. Prints and writes ``$OUT/gpu_check.json`` (blocking times, load times, results).

    PYTHONPATH=. python3 scripts/device_check_local_tier.py
"""
import json
import os
import shutil
import tempfile
import time
import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore")
OUT = os.environ.get("OUT", "/tmp")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
res = {"torch": torch.__version__, "device": DEV}


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def state(step, mib=1024 if DEV == "cuda" else 16, n=4):
    g = torch.Generator(device=DEV).manual_seed(step)
    per = mib * (1 << 20) // n // 4
    sd = {f"w{i}": torch.randn(per, device=DEV, generator=g) for i in range(n)}
    sd["half"] = torch.randn(1000, 77, device=DEV, generator=g).to(torch.bfloat16)
    sd["cpu"] = torch.arange(10.0) * step
    sd["arr"] = np.arange(5) * step
    sd["blob"] = bytes([step % 256]) * 7
    sd["step"] = step
    return sd


def same(a, b):
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not (x.device == y.device and x.dtype == y.dtype and torch.equal(x, y)):
                return f"{k} differs"
        elif isinstance(x, np.ndarray):
            if x.tobytes() != y.tobytes():
                return f"{k} differs"
        elif x != y:
            return f"{k} differs"
    return None


def part_a():
    from hyper_parallel.core.distributed_checkpoint import CheckpointManager
    root = tempfile.mkdtemp(dir="/dev/shm")
    d, shm = os.path.join(root, "run"), os.path.join(root, "shm")
    with CheckpointManager(d, save_interval_steps=100, local_dir=shm, replicas=1, local_keep=1) as mgr:
        for s in range(1, 5):
            sd = state(s)
            sync()
            mgr.save(s, sd)
        mgr.wait()
        t = list(mgr.local_tier.timings)
        res["a_blocking_ms"] = [round(x.blocking_s * 1e3, 1) for x in t]
        res["a_snapshot_ms"] = [round(x.snapshot_s * 1e3, 1) for x in t]
        res["a_write_ms"] = [round(x.write_s * 1e3, 1) for x in t]
        res["a_pinned"] = bool(mgr.local_tier._pool._free and list(mgr.local_tier._pool._free.values())[0][0].pinned)
    target = state(0)
    keep = target["w0"]
    with CheckpointManager(d, local_dir=shm, replicas=1) as mgr:
        t0 = time.perf_counter()
        step = mgr.load(target)
        sync()
        res["a_load_s"] = round(time.perf_counter() - t0, 3)
        res["a_step"] = step
    res["a_in_place"] = target["w0"] is keep
    res["a_diff"] = same(state(4), target)
    shutil.rmtree(root)


def rank_b(rank, ws, root):
    from datetime import timedelta

    import torch.distributed as dist

    from hyper_parallel.core.distributed_checkpoint import CheckpointManager
    if DEV == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=60))
    out = {}

    def mine(s):
        sd = state(s * 10 + rank, mib=256 if DEV == "cuda" else 8)
        return sd

    with CheckpointManager(f"{root}/run", save_interval_steps=100, local_dir=f"{root}/node{rank}", node_rank=rank,
                           timeout=60) as mgr:
        for s in range(1, 4):
            mgr.save(s, mine(s))
        mgr.wait()
        out["confirmed"] = [t.confirmed for t in mgr.local_tier.timings]
        out["blocking_ms"] = [round(t.blocking_s * 1e3, 1) for t in mgr.local_tier.timings]
    dist.barrier()
    if rank == 1:
        shutil.rmtree(f"{root}/node1")  # node 1 lost
    dist.barrier()
    target = mine(0)
    with CheckpointManager(f"{root}/run", save_interval_steps=100, local_dir=f"{root}/node{rank}", node_rank=rank,
                           timeout=60) as mgr:
        t0 = time.perf_counter()
        step = mgr.load(target)
        sync()
        out["load_s"] = round(time.perf_counter() - t0, 3)
        rec = mgr.local_tier.last_recovery
        out.update(step=step, source=rec.source, holder=rec.holders[rank], fetched=rec.bytes_fetched)
    out["diff"] = same(mine(3), target)
    with open(f"{root}/b{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def part_b():
    import torch.multiprocessing as mp
    root = tempfile.mkdtemp(dir="/dev/shm")
    mp.start_processes(rank_b, args=(2, root), nprocs=2, start_method="spawn")
    res["b"] = [json.load(open(f"{root}/b{r}.json")) for r in range(2)]
    shutil.rmtree(root)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    for name, fn in (("a", part_a), ("b", part_b)):
        try:
            fn()
        except Exception:
            import traceback
            res[f"{name}_error"] = traceback.format_exc()[-3000:]
        print(json.dumps(res, indent=1), flush=True)
    with open(os.path.join(OUT, "gpu_check.json"), "w") as f:
        json.dump(res, f, indent=1)
