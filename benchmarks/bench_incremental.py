"""Incremental checkpoints (issues 12, 33): what a step of a fine-tuning run costs to save.

The state: a frozen base of ``--frozen-mb`` (fp32 weights that never change) and a trainable
part of ``--train-mb`` with AdamW state (``exp_avg``, ``exp_avg_sq``: the same size again,
twice), as in LoRA/adapter fine-tuning: by default 256 MiB frozen + 24 MiB trainable state.
One process saves it through ``CheckpointManager``, each way into its own directory, every
save committed (fsync'd) before the clock stops:

- ``hp full``: ``incremental=False`` — every step writes everything;
- ``hp incremental``: ``incremental=True`` at its defaults (``incremental_check="content"``):
  step 1 writes everything; later steps hash every chunk in full (a box of column bands as one
  hash of its memory), reuse those whose hash is unchanged and write the rest: exact whatever
  wrote the memory;
- ``hp incremental, version_counter (opt-in)``: ``incremental_check="version_counter"`` — chunks
  whose tensor's version stamp (memory + torch's version counter) and spot check are unchanged
  are reused unhashed, about 1/8 of those re-hashed per step (misses sparse writes behind the
  counter for up to 7 steps; see ``engine/incremental.py``);
- ``torch DCP``: ``torch.distributed.checkpoint.save`` of the same dict (no incremental mode).

Between steps the trainable tensors and their optimizer state change in place (as one AdamW
step would). A run is ``--reps`` saves into a fresh directory; per run, the full save's time is
the median of its saves and an incremental step's the median of saves 2..reps; reported are
the medians over ``--runs`` runs, with wall time, CPU seconds of the process (all threads) per
GiB of state, and bytes written. Targets: an exact incremental step (the default) <= 25 % of
the full save's time (issue 42) and <= 10 % of its bytes. Each run's last step is loaded back and compared exactly.

Usage::

    python benchmarks/bench_incremental.py      # 3 runs of 4 saves; table to benchmarks/results/incremental.md
    python benchmarks/bench_incremental.py --frozen-mb 32 --train-mb 1 --runs 1 --no-write   # quick
"""

from __future__ import annotations

import argparse
import datetime
import mmap
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

import torch  # noqa: E402

from benchmarks.common import Timer, bar_chart, table_head, table_row, text_table  # noqa: E402
from hyper_parallel.core.distributed_checkpoint import CheckpointManager, load  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
COLS = 1024
RESULTS = os.path.join(ROOT, "benchmarks", "results", "incremental.md")
OPT_IN = "hp incremental, version_counter (opt-in)"
MODES = {"hp full": dict(incremental=False), "hp incremental": dict(incremental=True),
         OPT_IN: dict(incremental=True, incremental_check="version_counter"), "torch DCP": None}
TIME_TARGET = 0.25  # an exact incremental step against a full save (issue 42)


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


SETTLE_S = 0.05  # after a training step, before a timed save (see train_step)


def train_step(sd: dict) -> None:
    """What one AdamW step changes: the trainable weights and their moments.

    Its tensor ops run on torch's intra-op (OpenMP) threads, which keep spinning for a while
    after the last one (~10 ms of a core on this build): the callers wait ``SETTLE_S`` after it,
    so that a save's time and CPU are the save's, as after a step that ran on an accelerator.
    """
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


def run_manager(root: str, sd: dict, reps: int, options: dict) -> tuple[list[tuple[float, float, int]], dict, dict]:
    """(wall s, CPU s, data bytes) of each save, a copy of what the last one saved, and the
    last incremental save's checks (bytes unread, hashed, spot-checked)."""
    out, saved, checks = [], {}, {}
    with CheckpointManager(root, keep_latest=2, **options) as mgr:
        for step in range(1, reps + 1):
            with Timer() as t:
                mgr.save(step, sd)  # synchronous: committed when it returns
            mgr.wait()  # retention's deletions run in the background; not part of the save
            out.append((t.wall_s, t.cpu_s, data_bytes(mgr.step_path(step))))
            saved = clone(sd) if step == reps else saved  # outside the timed region
            st = mgr.incremental_stats
            if st is not None:
                checks = {"unread": st.unread_bytes, "hashed": st.hashed_bytes, "sampled": st.sampled_bytes}
            train_step(sd)
            time.sleep(SETTLE_S)
    return out, saved, checks


def run_torch(root: str, sd: dict, reps: int) -> list[tuple[float, float, int]]:
    import torch.distributed.checkpoint as tdcp

    out = []
    for step in range(1, reps + 1):
        path = os.path.join(root, f"step_{step}")
        with Timer() as t, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.save(sd, checkpoint_id=path, no_dist=True)
        out.append((t.wall_s, t.cpu_s, data_bytes(path)))
        train_step(sd)
        time.sleep(SETTLE_S)
    return out


def run_raw(root: str, buf: mmap.mmap, nbytes: int, reps: int) -> list[tuple[float, float, int]]:
    """The disk's floor for a save of ``nbytes``: a new file of them written from page-aligned
    memory, 8 MiB per call, and fsync'd (O_DIRECT where the filesystem takes it, as our data
    files are); ``reps`` files, each timed like a save."""
    os.makedirs(root, exist_ok=True)
    size = -(-nbytes // 4096) * 4096
    view = memoryview(buf)[:size]
    out = []
    for step in range(1, reps + 1):
        path = os.path.join(root, f"raw_{step}")
        with Timer() as t:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0), 0o644)
                direct = True
            except OSError:  # no O_DIRECT here (tmpfs): buffered
                fd, direct = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), False
            end = size if direct else nbytes  # O_DIRECT writes whole blocks
            try:
                for off in range(0, end, 8 * MiB):
                    os.pwrite(fd, view[off:min(end, off + 8 * MiB)], off)
                os.fsync(fd)
            finally:
                os.close(fd)
        out.append((t.wall_s, t.cpu_s, nbytes))
    return out


def clone(sd):
    if isinstance(sd, dict):
        return {k: clone(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [clone(v) for v in sd]
    return sd.clone() if isinstance(sd, torch.Tensor) else sd


def per_run(saves: list[tuple[float, float, int]], incremental: bool) -> tuple[float, float, float]:
    """(wall, CPU, bytes) of one run: the median of its saves (of saves 2.. when incremental)."""
    later = saves[1:] if incremental and len(saves) > 1 else saves
    return tuple(statistics.median(s[i] for s in later) for i in range(3))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frozen-mb", type=float, default=256)
    ap.add_argument("--train-mb", type=float, default=8, help="trainable weights (AdamW moments add 2x)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=4, help="saves per run (save 1 of an incremental run is full)")
    ap.add_argument("--runs", type=int, default=3, help="runs per way; medians are reported")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--no-torch", action="store_true", help="leave torch DCP out")
    ap.add_argument("--no-write", action="store_true", help=f"do not write {os.path.relpath(RESULTS, ROOT)}")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="also draw each way's step: time and bytes written (e.g. docs/assets/incremental.png)")
    args = ap.parse_args(argv)

    base = tempfile.mkdtemp(prefix="hp_bench_inc_", dir=args.dir)
    start = build_state(args.frozen_mb, args.train_mb, args.layers)
    total = sum(t.numel() * t.element_size() for t in _tensors(start))
    load_before = os.getloadavg()
    head = (f"state: {total / MiB:.1f} MiB ({args.frozen_mb:g} MiB frozen, {args.train_mb:g} MiB trainable + "
            f"{2 * args.train_mb:g} MiB AdamW moments), {args.layers} layers; {args.runs} runs of {args.reps} saves; "
            f"torch {torch.__version__}; {os.cpu_count()} CPUs; dir {base}")
    print(head)
    modes = {k: v for k, v in MODES.items() if v is not None or not args.no_torch}
    # the disk's floor, measured in the same runs: what an incremental step must write (the
    # trainable tensors and their optimizer state) and what a full save writes
    changed = total - sum(t.numel() * t.element_size() for k, t in start["model"].items() if ".base." in k)
    raw_ways = {"raw write+fsync, changed bytes": changed, "raw write+fsync, all bytes": total}
    raw_buf = mmap.mmap(-1, -(-total // 4096) * 4096)
    raw_buf.write(os.urandom(MiB) * (len(raw_buf) // MiB) + os.urandom(len(raw_buf) % MiB))
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in [*modes, *raw_ways]}
    checks: dict[str, dict] = {}
    try:
        for rep in range(args.runs):
            for name, options in modes.items():
                d = os.path.join(base, f"{name.replace(' ', '_').replace(',', '')}_{rep}")
                sd = clone(start)
                if options is None:
                    saves = run_torch(d, sd, args.reps)
                else:
                    saves, saved, checks[name] = run_manager(d, sd, args.reps, options)
                    _check_last_step(d, saved, args.reps)
                runs[name].append(per_run(saves, bool(options and options.get("incremental"))))
                shutil.rmtree(d, ignore_errors=True)
            for name, nbytes in raw_ways.items():
                d = os.path.join(base, f"raw_{nbytes}_{rep}")
                runs[name].append(per_run(run_raw(d, raw_buf, nbytes, args.reps), False))
                shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        raw_buf.close()
    med = {name: tuple(statistics.median(r[i] for r in rs) for i in range(3)) for name, rs in runs.items()}
    full_t, _, full_b = med["hp full"]
    gib = total / GiB
    columns = ["way", "save (wall)", "CPU", "CPU s/GiB of state", "written", "time vs full", "bytes vs full"]
    rows = [[name, f"{w * 1e3:.1f} ms", f"{c:.3f} s", f"{c / gib:.3f}", f"{b / MiB:.1f} MiB",
             f"{w / full_t:.1%}", f"{b / full_b:.1%}"] for name, (w, c, b) in med.items()]
    inc_t, _, inc_b = med["hp incremental"]
    ok_t, ok_b = inc_t <= TIME_TARGET * full_t, inc_b <= 0.10 * full_b
    ck, ck_opt = checks.get("hp incremental", {}), checks.get(OPT_IN, {})
    lines = [
        f"incremental step (exact, the default): {inc_t / full_t:.1%} of the full save's time "
        f"(target <= {TIME_TARGET:.0%}: {'met' if ok_t else 'NOT met'}), {inc_b / full_b:.1%} of its bytes "
        f"(target <= 10%: {'met' if ok_b else 'NOT met'}); the version_counter opt-in: "
        f"{med[OPT_IN][0] / full_t:.1%} of the time",
        f"last incremental step's checks: {ck.get('hashed', 0) / MiB:.1f} MiB hashed (every chunk), "
        f"{ck.get('unread', 0) / MiB:.1f} MiB reused unread; with the opt-in: {ck_opt.get('unread', 0) / MiB:.1f} "
        f"MiB reused unread, {ck_opt.get('hashed', 0) / MiB:.1f} MiB hashed (written + the rotating re-hash), "
        f"{ck_opt.get('sampled', 0) / MiB:.2f} MiB spot-checked",
        f"this disk's floor for it: a new file of the changed bytes ({changed / MiB:.1f} MiB) written and fsync'd "
        f"takes {med['raw write+fsync, changed bytes'][0] / med['raw write+fsync, all bytes'][0]:.1%} of the time "
        f"of the same for all the bytes ({med['raw write+fsync, changed bytes'][0] * 1e3:.1f} ms against "
        f"{med['raw write+fsync, all bytes'][0] * 1e3:.1f} ms)",
    ]
    print()
    print(text_table(columns, rows, indent=0))
    print()
    print("\n".join(lines))
    if args.plot:
        stem, ext = os.path.splitext(args.plot)
        note = (f"benchmarks/bench_incremental.py: {total / MiB:.0f} MiB state, {args.runs} runs of {args.reps} saves; "
                f"load average {load_before[0]:.1f} on {os.cpu_count()} cores")
        drawn = [bar_chart(f"{stem}_time{ext}", "One save of a fine-tuning step: time (committed, fsync'd)",
                           [(name, w * 1e3) for name, (w, _, _) in med.items()], "milliseconds (median)", note),
                 bar_chart(f"{stem}_bytes{ext}", "One save of a fine-tuning step: bytes written",
                           [(name, b / MiB) for name, (_, _, b) in med.items()], "MiB", note)]
        print(f"charts: {', '.join(map(str, drawn))}" if all(drawn) else "no chart: matplotlib is not installed")
    if not args.no_write:
        cmd = "python benchmarks/bench_incremental.py " + " ".join(argv if argv is not None else sys.argv[1:])
        doc = [f"# Incremental saves ({datetime.date.today().isoformat()})", "", f"`{cmd.strip()}`", "", head, "",
               "Medians of the runs; per run, the median of its saves (saves 2.. for the incremental ways). "
               "CPU: user + system seconds of the process, all threads.", "",
               *table_head(*columns), *(table_row(*r) for r in rows), "", *(f"- {x}" for x in lines),
               f"- load average before the run: {' '.join(f'{x:.2f}' for x in load_before)}", ""]
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "w") as f:
            f.write("\n".join(doc))
        print(f"\nwritten to {os.path.relpath(RESULTS, ROOT)}")
    return 0 if ok_b and ok_t else 1


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
