"""Does an async save slow the training loop? Ours (background threads) vs torch DCP's THREAD and
PROCESS async checkpointers, in one process.

Metric as in ``dcp_ranks.py``'s async case: a loop's step rate while the save is in flight over
its idle rate ("kept"), and the compute lost per save (blocking time + (1 - kept) x time in
flight). ``STEP=py`` runs a loop that holds the GIL (Python arithmetic) instead of a matmul.

    MB=256 .venv/bin/python benchmarks/bench_async_process.py [DIR]
    STEP=py MB=256 .venv/bin/python benchmarks/bench_async_process.py [DIR]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from hyper_parallel.core.distributed_checkpoint import async_save

N = 768


def main() -> None:
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(dir=sys.argv[1] if len(sys.argv) > 1 else None)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    sd = {f"t{i}": torch.randn(1024, 256) for i in range(int(os.environ.get("MB", "256")))}  # 1 MiB each
    a, w, c = torch.randn(N, N), torch.randn(N, N), torch.empty(N, N)
    py = os.environ.get("STEP") == "py"

    def step() -> None:
        if py:
            sum(i * i for i in range(20000))
        else:
            torch.mm(a, w, out=c)

    def rate_for(seconds: float) -> float:
        k, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            step()
            k += 1
        return k / (time.monotonic() - t0)

    for name in os.environ.get("ORDER", "ours,torch-process,torch-thread," * 3).strip(",").split(","):
        path = os.path.join(root, f"{name}-{time.time_ns()}")
        idle = rate_for(2.0)
        t0 = time.monotonic()
        if name == "ours":
            fut = async_save(sd, checkpoint_id=path)
        else:
            kind = AsyncCheckpointerType.PROCESS if name == "torch-process" else AsyncCheckpointerType.THREAD
            resp = tdcp.async_save(sd, checkpoint_id=path, async_checkpointer_type=kind)
            fut = getattr(resp, "upload_completion", resp)
        t_ret = time.monotonic()
        k = 0
        while not fut.done():
            step()
            k += 1
        t_seen = time.monotonic()
        fut.result()
        kept = k / (t_seen - t_ret) / idle if k else float("nan")
        lost = (t_ret - t0) + (t_seen - t_ret) * (1 - kept)
        print(f"{name:14s} blocks {t_ret - t0:6.3f} s, done after {t_seen - t0:6.2f} s, kept {kept:.2f}, "
              f"compute lost {lost:.2f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
