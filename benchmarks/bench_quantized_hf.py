#!/usr/bin/env python
"""Loading an FP8 block-quantized Hugging Face checkpoint: ours vs torch's reader.

Writes ``--mib`` MiB of float8 weights (``--n`` square weights of DeepSeek-V3's 128 blocks,
with their float32 ``weight_scale_inv``) into two safetensors files and an index, then loads
them into ``--into`` targets in one process (``no_dist``), page cache warm, with
``QuantizedHuggingFaceStorageReader`` of this library and of torch. Reports the best and the
median of ``--reps`` loads of each, and checks that both give the same bits.

Usage::

    python benchmarks/bench_quantized_hf.py                 # 256 MiB, 16 weights, into bfloat16
    python benchmarks/bench_quantized_hf.py --mib 64 --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--n", type=int, default=16, help="number of weights")
    ap.add_argument("--into", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()

    import torch
    import torch.distributed.checkpoint as torch_dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader as Theirs

    from hyper_parallel.core.distributed_checkpoint import QuantizedHuggingFaceStorageReader as Ours
    from hyper_parallel.core.distributed_checkpoint import load

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    into = getattr(torch, args.into)
    side = int((args.mib * 2**20 // args.n) ** 0.5) // 128 * 128
    d = tempfile.mkdtemp(prefix="bench_fp8_", dir=args.dir)
    try:
        g = torch.Generator().manual_seed(0)
        weight_map, files = {}, [{}, {}]
        for i in range(args.n):
            key = f"layers.{i}.mlp.weight"
            files[i % 2][key] = (torch.randn(side, side, generator=g) * 50).to(torch.float8_e4m3fn)
            files[i % 2][key + "_scale_inv"] = torch.rand(side // 128, side // 128, generator=g) * 1e-2
        for j, tensors in enumerate(files):
            name = f"model-{j + 1:05d}-of-00002.safetensors"
            save_file(tensors, os.path.join(d, name))
            weight_map.update(dict.fromkeys(tensors, name))
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": weight_map}, f)
        keys = sorted(k for k in weight_map if k.endswith(".weight"))
        targets = {k: torch.empty(side, side, dtype=into) for k in keys}

        def ours() -> None:
            load(targets, storage_reader=Ours(d, target_dtype=into), no_dist=True)

        def theirs() -> None:
            torch_dcp.load(targets, storage_reader=Theirs(d, target_dtype=into), no_dist=True)

        times: dict[str, list[float]] = {"ours": [], "torch": []}
        got: dict[str, dict] = {}
        for _ in range(args.reps):
            for name, fn in (("ours", ours), ("torch", theirs)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                got[name] = {k: v.clone() for k, v in targets.items()}
        same = all(torch.equal(got["ours"][k].view(torch.int16 if into == torch.bfloat16 else torch.int32),
                               got["torch"][k].view(torch.int16 if into == torch.bfloat16 else torch.int32))
                   for k in keys)
        total = args.n * side * side / 2**20
        print(f"{args.n} weights {side}x{side} float8 ({total:.0f} MiB) into {args.into}, best/median of {args.reps}:")
        for name, ts in times.items():
            print(f"  {name:6s} {min(ts):7.3f} s / {statistics.median(ts):7.3f} s  ({total / min(ts):7.1f} MiB/s)")
        print(f"  same bits: {same}; torch / ours (best): {min(times['torch']) / min(times['ours']):.1f}x")
        if not same:
            sys.exit(1)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
