"""Loading a checkpoint stock torch DCP wrote: ours (in place, safe decoding) against torch's own load.

One process: torch writes ``--tensors`` float32 tensors of ``--mib`` MiB in all plus a few plain
values with ``torch.distributed.checkpoint.save``; then each of ``torch.distributed.checkpoint.load``
and our ``load`` fills the same zeroed target ``--reps`` times (alternating, page cache warm after
the first), and the median and range of each are printed with the values checked bit-exact.

    .venv/bin/python benchmarks/bench_torch_written_load.py --mib 256 --tensors 64 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as tdcp

from hyper_parallel.core.distributed_checkpoint import load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    warnings.simplefilter("ignore")
    rows = args.mib * (1 << 20) // 4 // args.tensors // 1024
    g = torch.Generator().manual_seed(0)
    sd = {"model": {f"t{i}": torch.randn(rows, 1024, generator=g) for i in range(args.tensors)},
          "extra": {"step": 7, "lr": 0.01, "name": "run"}}
    with tempfile.TemporaryDirectory() as path:
        tdcp.save(sd, checkpoint_id=path, no_dist=True)

        def target() -> dict:
            return {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
                    "extra": {"step": 0, "lr": 0.0, "name": ""}}

        times: dict[str, list[float]] = {"torch": [], "ours": []}
        for _ in range(args.reps):
            for name, fn in (("torch", lambda t: tdcp.load(t, checkpoint_id=path, no_dist=True)),
                             ("ours", lambda t: load(t, checkpoint_id=path, no_dist=True))):
                t = target()
                start = time.perf_counter()
                fn(t)
                times[name].append(time.perf_counter() - start)
                assert all(torch.equal(t["model"][k], v) for k, v in sd["model"].items()), name
                assert t["extra"] == sd["extra"], name
    for name, ts in times.items():
        print(f"{name:5s}: median {statistics.median(ts):.3f} s (min {min(ts):.3f}, max {max(ts):.3f}) "
              f"for {args.mib} MiB in {args.tensors} tensors")


if __name__ == "__main__":
    main()
