"""Run a function on N real gloo ranks (separate processes) and collect every rank's outcome.

Children come from a forkserver that imported torch once, so a launch costs a fork, not an
``import torch`` per rank, and no child is forked from a process that holds a process group.
Errors from all ranks are collected and reported root cause first; nothing hangs: a
deadline kills stragglers, and children die with the parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "hyper_parallel.core.distributed_checkpoint"])


class RankFailure(AssertionError):
    """One or more ranks failed; the message holds each rank's traceback."""


def _worker(rank: int, ws: int, init_file: str, fn: Callable, args: tuple, pg_timeout_s: float, q: Any) -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except Exception:
        pass
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        q.put((rank, "ok", fn(rank, ws, *args)))
    except BaseException:
        q.put((rank, "err", traceback.format_exc()))
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120,
              pg_timeout_s: float = 30, grace_s: float = 5.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be a module-level function; its return value must pickle.
    """
    q = _CTX.SimpleQueue()
    d = tempfile.mkdtemp(prefix="hp_dist_")
    init_file = os.path.join(d, "store")
    procs = [_CTX.Process(target=_worker, args=(r, world_size, init_file, fn, args, pg_timeout_s, q))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    first_err = None
    try:
        while len(results) < world_size:
            while not q.empty():
                r, kind, payload = q.get()
                results[r] = (kind, payload)
                if kind != "ok" and first_err is None:
                    first_err = time.monotonic()
            now = time.monotonic()
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
            if dead:
                time.sleep(1.0)  # its last message may still be on the way
                if q.empty():
                    for i in dead:
                        results[i] = ("crash", f"rank {i} exited with code {procs[i].exitcode}")
                    first_err = first_err or now
            if (first_err is not None and now - first_err > grace_s) or now > deadline:
                break
            time.sleep(0.01)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(init_file):
            os.unlink(init_file)
        os.rmdir(d)
    # A rank marked crashed because its exit was seen before its message: keep what it said.
    while not q.empty():
        r, kind, payload = q.get()
        if results.get(r, ("crash",))[0] == "crash":
            results[r] = (kind, payload)
    errs = {r: v for r, v in results.items() if v[0] != "ok"}
    missing = [r for r in range(world_size) if r not in results]
    if errs or missing:
        lines = [f"{len(errs)} rank(s) failed; missing: {missing}"]
        lines += [f"===== rank {r} [{k}] =====\n{tb}" for r, (k, tb) in sorted(errs.items())]
        if not errs:
            lines.append(f"timeout after {timeout_s}s")
        raise RankFailure("\n".join(lines))
    return [results[r][1] for r in range(world_size)]
