"""Time MindSpore import/export on a ~1 GiB state, with peak memory, and MindSpore's own times.

    .venv/bin/python benchmarks/bench_mindspore.py [--mib 1024] [--dir /tmp/bench_ms]

Steps (each in a fresh process, so its peak RSS — VmHWM — is its own):
  export   our checkpoint -> one .ckpt (a 60% tensor above MindSpore's 512 MiB slice size)
  import   that .ckpt -> our checkpoint (crc trailer checked)
  dist     a TP=2 MindSpore distributed checkpoint (sliced by mindspore.transform_checkpoints
           from our strategy file) -> our checkpoint
With MindSpore (HP_MINDSPORE_PYTHON or .msenv) it also times mindspore.load_checkpoint and
save_checkpoint of the same file and checks MindSpore's re-save is byte-identical to ours.
Page cache is warm (the files were just written); times exclude interpreter start and imports;
our writes fsync. Prints one JSON line per step.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mindspore_python() -> str | None:
    exe = os.environ.get("HP_MINDSPORE_PYTHON") or os.path.join(REPO, ".msenv", "bin", "python")
    ok = os.environ.get("HP_MINDSPORE_PYTHON") or glob.glob(
        os.path.join(REPO, ".msenv", "lib", "python*", "site-packages", "mindspore", "__init__.py"))
    return exe if os.path.exists(exe) and ok else None


def step(python: str, code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it sets ``result``; add wall time (imports excluded) and peak RSS."""
    prelude = "import mindspore" if python != sys.executable else \
        "import torch, hyper_parallel.core.distributed_checkpoint"
    wrapper = textwrap.dedent(f"""
        import json, time
        {prelude}
        t0 = time.perf_counter()
        result = {{}}
    """) + textwrap.dedent(code) + textwrap.dedent("""
        result["seconds"] = round(time.perf_counter() - t0, 3)
        hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
        result["peak_rss_mib"] = round(int(hwm) / 1024)
        print("RESULT " + json.dumps(result))
    """)
    out = subprocess.run([python, "-c", wrapper], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "GLOG_v": "3"})
    if out.returncode:
        sys.exit(f"step failed:\n{out.stderr[-3000:]}")
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024, help="total size of the state (default 1024)")
    ap.add_argument("--dir", default="/tmp/bench_ms")
    args = ap.parse_args()
    d = args.dir
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    py = sys.executable
    mib = args.mib
    # big fp32 (60%), bf16 (25%), two fp16 (6% each), small ones
    step(py, f"""
        import torch
        from hyper_parallel.core.distributed_checkpoint import save
        m = {mib} << 20
        g = torch.Generator().manual_seed(0)
        rows = lambda share, itemsize, cols: int(m * share) // itemsize // cols // 8 * 8  # MindSpore splits evenly
        sd = {{"big": torch.randn(rows(0.60, 4, 1024), 1024, generator=g),
              "emb": torch.randn(rows(0.25, 2, 512), 512, generator=g).bfloat16(),
              "w1": torch.randn(rows(0.06, 2, 256), 256, generator=g).half(),
              "w2": torch.randn(rows(0.06, 2, 256), 256, generator=g).half(),
              "ids": torch.arange(1000, dtype=torch.int64), "step": torch.tensor(7)}}
        save(sd, {d + "/src"!r}, no_dist=True)
    """)
    rows = []
    r = step(py, f"""
        from hyper_parallel.core.distributed_checkpoint import export_mindspore
        s = export_mindspore({d + "/src"!r}, {d + "/model.ckpt"!r}, crc=True)
        result.update(step="export .ckpt (ours)", bytes=s.bytes)
    """)
    rows.append(r)
    rows.append(step(py, f"""
        from hyper_parallel.core.distributed_checkpoint import import_mindspore
        import_mindspore({d + "/model.ckpt"!r}, {d + "/imported"!r})
        result.update(step="import .ckpt (ours, crc checked)")
    """))
    rows.append(step(py, f"""
        from hyper_parallel.core.distributed_checkpoint import export_mindspore
        s = export_mindspore({d + "/src"!r}, {d + "/model.safetensors"!r})
        result.update(step="export safetensors (ours)", bytes=s.bytes)
    """))
    ms = mindspore_python()
    if ms:
        rows.append(step(ms, f"""
            import mindspore as ms
            p = ms.load_checkpoint({d + "/model.ckpt"!r}, crc_check=True)
            result.update(step="mindspore.load_checkpoint .ckpt (crc_check)")
        """))
        rows.append(step(ms, f"""
            import mindspore as ms
            p = ms.load_checkpoint({d + "/model.ckpt"!r})
            t = time.perf_counter()
            ms.save_checkpoint(list(p.values()), {d + "/resaved.ckpt"!r}, crc_check=True)
            same = open({d + "/resaved.ckpt"!r}, "rb").read() == open({d + "/model.ckpt"!r}, "rb").read()
            result.update(step="mindspore.save_checkpoint .ckpt (crc)", identical_to_ours=same,
                          save_seconds=round(time.perf_counter() - t, 3))
        """))
        # a TP=2 distributed checkpoint, sliced by MindSpore from our strategy file
        step(py, f"""
            import os
            from hyper_parallel.core.distributed_checkpoint import Layout, save_layout
            mesh = Layout((2,), ("tp",))
            save_layout({{"big": mesh("tp", "None"), "emb": mesh("None", "tp"), "w1": mesh("tp", "None"),
                          "w2": mesh("None", "tp")}}, {d + "/strategy.ckpt"!r}, format="mindspore")
            os.makedirs({d + "/whole/rank_0"!r})
            os.link({d + "/model.ckpt"!r}, {d + "/whole/rank_0/net.ckpt"!r})
        """)
        rows.append(step(ms, f"""
            import mindspore as ms
            ms.transform_checkpoints({d + "/whole"!r}, {d + "/tp2"!r}, "net", None, {d + "/strategy.ckpt"!r})
            result.update(step="mindspore.transform_checkpoints whole -> TP=2 (setup)")
        """))
        rows.append(step(py, f"""
            from hyper_parallel.core.distributed_checkpoint import import_mindspore
            m = import_mindspore({d + "/tp2"!r}, {d + "/imported_tp2"!r}, strategy={d + "/strategy.ckpt"!r})
            result.update(step="import TP=2 distributed (ours)", files=len(m.files))
        """))
    for r in rows:
        print(json.dumps(r))
    size = os.path.getsize(os.path.join(d, "model.ckpt"))
    print(json.dumps({"file": "model.ckpt", "bytes": size, "mib": round(size / 2**20, 1)}))
    t = time.time()
    shutil.rmtree(d, ignore_errors=True)
    print(json.dumps({"cleanup_seconds": round(time.time() - t, 2)}))


if __name__ == "__main__":
    main()
