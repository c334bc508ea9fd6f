"""The DCP benchmark runs end to end (--quick, tiny state) and reports every scenario.

A smoke test, not a performance test: it checks the JSON's shape and that every load put
the right values in place, never a timing.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCENARIOS = ("sync_save", "load_same", "load_reshard_s0_s1", "load_reshard_2n_n", "load_n_1")


def test_quick_benchmark_reports_every_scenario(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_dcp.py"), "--quick", "--size", "2MiB",
           "--out", str(out), "--dir", str(tmp_path), "--plan-ranks", "16,32", "--plan-tensors", "10",
           "--compute-s", "0.1", "--compute-n", "128", "--cold", "fadvise"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    doc = json.loads((out / "latest.json").read_text())
    assert (out / "latest.md").read_text().startswith("# DCP benchmark")

    res = doc["results"]
    assert set(res["limits"]) >= {"write", "write_fsync", "read_cold", "read_warm", "memcpy_fresh", "memcpy_reused"}
    for name in SCENARIOS:
        entry = res["scenarios"][name]
        assert "error" not in entry, f"{name}: {entry.get('error')}"
        assert {"ours", "torch"} <= set(entry["variants"]), f"{name}: {sorted(entry['variants'])}"
        if name != "sync_save":
            assert all(entry["correct"].values()), f"{name}: wrong values loaded: {entry['correct']}"
    assert "ours_noverify" in res["scenarios"]["load_reshard_s0_s1"]["variants"]
    assert set(res["scenarios"]["reference"]["variants"]) == {
        "torch_save", "safetensors_save", "torch_load", "safetensors_load"}
    async_ = res["scenarios"]["async_save"]
    assert "error" not in async_, async_.get("error")
    assert "torch" in async_["variants"]
    assert async_["available"] == ("ours" in async_["variants"])
    assert res["offline"].get("available") or res["offline"].get("note")
    assert [p["ranks"] for p in res["planning"]["points"] if not p["extrapolated"]] == [16, 32]
    assert res["planning"]["target"]["ranks"] == 8192
    assert len(doc["targets"]) >= 10 and all("met" in t for t in doc["targets"])
    assert doc["machine"]["uptime_start"]
    assert not list(tmp_path.glob("hp-dcp-bench-*")), "the benchmark left its checkpoints behind"
