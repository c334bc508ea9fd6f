"""The incremental-save benchmark runs end to end on a tiny state and reports every way,
the disk's floor beside them, and the targets. A smoke test: it checks the report, never a
timing (the exit status says whether this machine met the targets, so either is accepted)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tiny_run_reports_every_way_and_the_disk_floor(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_incremental.py"), "--frozen-mb", "4",
           "--train-mb", "0.25", "--layers", "4", "--reps", "3", "--runs", "1", "--no-write", "--dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode in (0, 1), f"benchmark failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = proc.stdout
    for way in ("hp full", "hp incremental", "hp incremental, version_counter (opt-in)", "torch DCP",
                "raw write+fsync, changed bytes", "raw write+fsync, all bytes"):
        assert f"\n{way} " in out, f"{way!r} missing from:\n{out}"
    assert "incremental step (exact, the default): " in out and "of the full save's time" in out
    # 4 layers of 0.0625 MiB trainable weights, each with two AdamW moments, and a step counter each
    assert "a new file of the changed bytes (0.8 MiB) written and fsync'd takes" in out, out
    assert not os.listdir(tmp_path), "the benchmark left files behind"
