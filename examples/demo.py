"""The end-to-end demo: train on 4 processes, crash, resume on 2, convert offline, summarize.

1. 4 processes (FSDP2, 4 shards) train a small transformer on synthetic data; a
   ``CheckpointManager`` saves the whole training state asynchronously every 10 steps (with
   the loss as a metric), then the job stops at step 35 as if it crashed: step 30 is the
   newest committed one.
2. 2 processes (FSDP2, 2 shards: a different layout) resume from it, re-run steps 31-35
   (their losses must match the first run's within 1e-5 relative), and train on to 50.
   Retention (newest 2, every 20th, lowest loss) decides which steps stay.
3. The final checkpoint (2 shards) is rewritten offline, in this process, for a 4-rank
   layout (``offline_transform``), verified byte by byte (``verify_checkpoint``), and
   checked to hold the same values.

Run: ``bash scripts/demo.sh`` (installs, then runs this), or ``python examples/demo.py``.
Output goes to ``demo_output/`` (replaced on every run).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from dataclasses import replace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_fsdp import Config, directory_bytes, latest_checkpoint, launch  # noqa: E402

from hyper_parallel.core.distributed_checkpoint import (  # noqa: E402
    list_steps,
    load,
    offline_transform,
    verify_checkpoint,
)

REL_TOL = 1e-5


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def tensors_equal(a: object, b: object) -> bool:
    """Deep equality of two loaded state dicts (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(tensors_equal, a, b))
    return a == b


def convert_offline(src: str, dst: str, shards: int) -> dict:
    """Rewrite ``src`` for a ``shards``-rank FSDP layout, in this process; verify the values."""
    started = time.perf_counter()
    offline_transform(src, dst, dst_layout={"dp": shards})
    seconds = time.perf_counter() - started
    report = verify_checkpoint(dst)
    same = report.ok and tensors_equal(load(path=src), load(path=dst))
    files = [f for f in os.listdir(dst) if not f.startswith(".")]
    return {"seconds": seconds, "same": same, "files": len(files), "bytes": directory_bytes(dst)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo_output", help="output directory (replaced)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    shutil.rmtree(args.out, ignore_errors=True)
    cfg = Config(ckpt_dir=os.path.join(args.out, "checkpoints"), steps=50, save_every=10)

    print("== hyper-parallel DCP demo: FSDP2 on CPU/gloo, async checkpoints, resume on a new layout ==")
    print(f"model: {cfg.layers}-layer transformer, d_model {cfg.d_model}, vocab {cfg.vocab}; "
          f"global batch {cfg.global_batch} x {cfg.seq} tokens; AdamW + warmup")

    print("\n[1] 4 processes (FSDP2, 4 shards): train, async checkpoints every 10 steps, crash after step 35")
    first = launch(replace(cfg, stop_at=35), 4)
    for s in first["saves"]:
        print(f"    async save of step {s['step']:2d}: training blocked {s['blocking_s'] * 1e3:6.1f} ms, "
              f"committed after {s['total_s']:.2f} s")
    committed = latest_checkpoint(cfg.ckpt_dir)
    assert committed is not None, "no committed checkpoint after phase 1"
    print(f"    crashed after step {max(first['losses'])}; latest committed checkpoint: "
          f"{os.path.basename(committed[1])} (kept: steps {first['kept']})")

    print("\n[2] 2 processes (FSDP2, 2 shards): resume from the latest committed checkpoint")
    second = launch(cfg, 2)
    r = second["resumed_from"]
    print(f"    loaded {os.path.basename(r['path'])} in {r['load_s']:.2f} s: step {r['step']}, "
          f"data position {r['data_position']}, lr {r['lr']:.2e}, "
          f"RNG states {'restored' if r['rng_restored'] else 'kept (different rank count)'}")
    rerun = sorted(set(first["losses"]) & set(second["losses"]))
    worst = max(abs(second["losses"][s] - first["losses"][s]) / abs(first["losses"][s]) for s in rerun)
    print(f"    steps {rerun[0]}-{rerun[-1]} ran on both layouts: max relative loss difference {worst:.1e} "
          f"({'OK' if worst <= REL_TOL else 'FAILED'}, tolerance {REL_TOL:g})")
    for s in second["saves"]:
        print(f"    async save of step {s['step']:2d}: training blocked {s['blocking_s'] * 1e3:6.1f} ms, "
              f"committed after {s['total_s']:.2f} s")

    final_step, final_path = latest_checkpoint(cfg.ckpt_dir)
    kept = [(i.step, (i.metrics or {}).get("loss")) for i in list_steps(cfg.ckpt_dir) if i.state == "committed"]
    print(f"    retention (newest {cfg.keep_latest}, every {cfg.keep_every}th, lowest loss) kept "
          + ", ".join(f"step {s} (loss {loss:.4f})" for s, loss in kept))
    print(f"\n[3] offline conversion of {os.path.basename(final_path)}: 2 shards -> 4 shards, no processes")
    conv = convert_offline(final_path, os.path.join(args.out, "converted_4_shards"), 4)
    print(f"    offline_transform wrote {conv['files']} data files ({human(conv['bytes'])}) in "
          f"{conv['seconds']:.2f} s; verified, values {'identical' if conv['same'] else 'DIFFERENT'} to the source")

    print("\n== summary ==")
    print("  step | loss, 4 processes | loss, 2 processes (resumed)")
    shown = sorted({1, 10, 20, 30, 31, 35, 40, 50} & (set(first["losses"]) | set(second["losses"])))
    for s in shown:
        a = f"{first['losses'][s]:.6f}" if s in first["losses"] else "-"
        b = f"{second['losses'][s]:.6f}" if s in second["losses"] else "-"
        print(f"  {s:4d} | {a:>17} | {b:>15}")
    saves = first["saves"] + second["saves"]
    size = directory_bytes(final_path)
    print(f"  steps: {max(first['losses'])} on 4 processes (crash), resumed at {r['step'] + 1}, "
          f"{final_step} reached on 2 processes")
    print(f"  loss: {first['losses'][1]:.4f} at step 1 -> {first['losses'][r['step']]:.4f} at the checkpoint "
          f"(step {r['step']}) -> {second['losses'][final_step]:.4f} at step {final_step}")
    print(f"  checkpoints kept: steps {[s for s, _ in kept]} of {[s['step'] for s in saves]} saved")
    print(f"  async saves: {len(saves)}, training blocked {np.mean([s['blocking_s'] for s in saves]) * 1e3:.1f} ms "
          f"on average, commit {np.mean([s['total_s'] for s in saves]):.2f} s on average")
    print(f"  load (resume, 4 -> 2 shards): {r['load_s']:.2f} s")
    print(f"  checkpoint size: {human(size)} per checkpoint "
          f"({len([f for f in os.listdir(final_path) if not f.startswith('.')])} data files + .metadata)")
    if conv:
        print(f"  offline conversion: {conv['seconds']:.2f} s, {'verified' if conv['same'] else 'MISMATCH'}")
    print(f"  wall time: {time.perf_counter() - t0:.1f} s")
    ok = worst <= REL_TOL and conv["same"] and not math.isnan(second["losses"][final_step])
    if not ok:
        raise SystemExit("demo FAILED: see above")


if __name__ == "__main__":
    main()
