#!/usr/bin/env python
"""Incremental checkpoints (issue 12): what the second save of a fine-tuning run costs.

The state: a frozen base of ``--frozen-mb`` (fp32 weights that never change) and a trainable
part of ``--train-mb`` with AdamW state (``exp_avg``, ``exp_avg_sq``: the same size again,
twice), as in LoRA/adapter fine-tuning. One process saves it through ``CheckpointManager``
four ways, each into its own directory, every save committed (fsync'd) before the clock stops:

- ``hp full``: ``incremental=False`` — every step writes everything;
- ``hp incremental``: ``incremental=True`` — step 1 writes everything, later steps write only
  the chunks whose xxh3-128 hash changed and reference step 1's file for the rest;
- ``torch DCP``: ``torch.distributed.checkpoint.save`` of the same dict (no incremental mode).

Between steps the trainable tensors and their optimizer state change (as one AdamW step
would). Reported per step: wall time and bytes written to data files; then the targets:
the incremental saves after the first write <= 10 % of a full save's bytes and take <= 20 % of
its time (the median of every full save of the run: single saves swing a lot on a shared
box). Each run's last step is loaded back and compared exactly.

Usage::

    python benchmarks/bench_incremental.py                    # 256 MiB frozen + 8 MiB trainable
    python benchmarks/bench_incremental.py --frozen-mb 32 --train-mb 1 --steps 2   # quick
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.common import Timer, text_table  # noqa: E402
from hyper_parallel.core.distributed_checkpoint import CheckpointManager, load  # noqa: E402

MiB = 1 << 20
COLS = 1024


def build_state(frozen_mb: float, train_mb: float, layers: int) -> dict:
    """``layers`` frozen fp32 matrices totalling ``frozen_mb`` and trainable ones + AdamW state."""
    g = torch.Generator().manual_seed(0)
    rows = max(1, int(frozen_mb * MiB / 4 / COLS / layers))
    trows = max(1, int(train_mb * MiB / 4 / COLS / layers))
    model, state = {}, {}
    for i in range(layers):
        model[f"layers.{i}.base.weight"] = torch.randn(rows, COLS, generator=g)
        model[f"layers.{i}.adapter.weight"] = torch.randn(trows, COLS, generator=g)
        state[i] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(trows, COLS),
                    "exp_avg_sq": torch.zeros(trows, COLS)}
    return {"model": model, "optim": {"state": state, "param_groups": [{"lr": 1e-4, "params": list(range(layers))}]}}


def train_step(sd: dict) -> None:
    """What one AdamW step changes: the trainable weights and their moments."""
    for i, st in sd["optim"]["state"].items():
        w = sd["model"][f"layers.{i}.adapter.weight"]
        grad = torch.randn_like(w)
        st["step"] += 1
        st["exp_avg"].mul_(0.9).add_(grad, alpha=0.1)
        st["exp_avg_sq"].mul_(0.999).addcmul_(grad, grad, value=0.001)
        w.sub_(1e-4 * st["exp_avg"] / (st["exp_avg_sq"].sqrt() + 1e-8))


def data_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if not f.startswith(".") and os.path.isfile(os.path.join(path, f)))


def run_manager(root: str, sd: dict, steps: int, incremental: bool) -> tuple[list[tuple[float, int]], dict]:
    """Times and bytes of each step's save, and a copy of what the last step saved."""
    out, saved = [], {}
    with CheckpointManager(root, incremental=incremental, keep_latest=2) as mgr:
        for step in range(1, steps + 1):
            with Timer() as t:
                mgr.save(step, sd)  # synchronous: committed when it returns
            mgr.wait()  # retention's deletions run in the background; not part of the save
            out.append((t.wall_s, data_bytes(mgr.step_path(step))))
            saved = clone(sd) if step == steps else saved  # outside the timed region
            train_step(sd)
    return out, saved


def run_torch(root: str, sd: dict, steps: int) -> list[tuple[float, int]]:
    import torch.distributed.checkpoint as tdcp

    out = []
    for step in range(1, steps + 1):
        path = os.path.join(root, f"step_{step}")
        with Timer() as t, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.save(sd, checkpoint_id=path, no_dist=True)
        out.append((t.wall_s, data_bytes(path)))
        train_step(sd)
    return out


def clone(sd):
    if isinstance(sd, dict):
        return {k: clone(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [clone(v) for v in sd]
    return sd.clone() if isinstance(sd, torch.Tensor) else sd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frozen-mb", type=float, default=256)
    ap.add_argument("--train-mb", type=float, default=8)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4, help="saves per run (step 1 is the full one)")
    ap.add_argument("--reps", type=int, default=1, help="repeat the runs; medians are reported")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args(argv)

    base = tempfile.mkdtemp(prefix="hp_bench_inc_", dir=args.dir)
    start = build_state(args.frozen_mb, args.train_mb, args.layers)
    total = sum(t.numel() * t.element_size() for t in _tensors(start))
    print(f"state: {total / MiB:.1f} MiB ({args.frozen_mb:g} MiB frozen, {args.train_mb:g} MiB trainable"
          f" + AdamW moments), {args.layers} layers; torch {torch.__version__}; dir {base}")
    runs: dict[str, list[list[tuple[float, int]]]] = {"hp full": [], "hp incremental": [], "torch DCP": []}
    try:
        for rep in range(args.reps):
            for name in runs:
                d = os.path.join(base, f"{name.replace(' ', '_')}_{rep}")
                sd = clone(start)
                if name == "torch DCP":
                    runs[name].append(run_torch(d, sd, args.steps))
                else:
                    times, saved = run_manager(d, sd, args.steps, incremental=name == "hp incremental")
                    runs[name].append(times)
                    _check_last_step(d, saved, args.steps)
                shutil.rmtree(d, ignore_errors=True)
        med = {name: [(statistics.median(r[s][0] for r in rs), statistics.median(r[s][1] for r in rs))
                      for s in range(args.steps)] for name, rs in runs.items()}
        print()
        print(text_table(["step", *med], [[s + 1, *(f"{med[n][s][0]:.3f} s {med[n][s][1] / MiB:9.1f} MiB" for n in med)]
                                          for s in range(args.steps)], indent=0))
        full_t = statistics.median(t for r in runs["hp full"] for t, _ in r)  # every full save, all reps
        full_b = med["hp full"][1][1]
        later = med["hp incremental"][1:]
        inc_t = statistics.median(t for t, _ in later)
        inc_b = max(b for _, b in later)
        ok_b, ok_t = inc_b <= 0.10 * full_b, inc_t <= 0.20 * full_t
        print(f"\nincremental save (steps 2..{args.steps}): {inc_b / full_b:.1%} of the full save's bytes "
              f"(target <= 10%: {'met' if ok_b else 'NOT met'}), {inc_t / full_t:.1%} of its time "
              f"(target <= 20%: {'met' if ok_t else 'NOT met'}); vs torch DCP's save: "
              f"{inc_t / statistics.median(t for t, _ in med['torch DCP'][1:]):.1%} of its time")
        return 0 if ok_b and ok_t else 1
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _tensors(sd):
    if isinstance(sd, dict):
        for v in sd.values():
            yield from _tensors(v)
    elif isinstance(sd, list):
        for v in sd:
            yield from _tensors(v)
    elif isinstance(sd, torch.Tensor):
        yield sd


def _check_last_step(root: str, saved: dict, steps: int) -> None:
    """The last step loads back exactly the state it saved."""
    out = load(path=os.path.join(root, f"step_{steps:08d}"))
    for k, v in saved["model"].items():
        if not torch.equal(out["model"][k], v):
            raise AssertionError(f"model.{k}: loaded values differ from the saved ones")
    for i, st in saved["optim"]["state"].items():
        for k, v in st.items():
            got = out["optim"]["state"][i][k]
            if not torch.equal(torch.as_tensor(got), v):
                raise AssertionError(f"optim.state.{i}.{k}: loaded values differ from the saved ones")


if __name__ == "__main__":
    raise SystemExit(main())
