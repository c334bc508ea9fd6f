"""The DCP benchmarks run end to end (--quick, tiny state) and report every scenario.

Smoke tests, not performance tests: they check the JSON's shape and that every load put
the right values in place, never a timing.
"""

import json
import math
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
    assert set(res["limits"]) >= {"write", "write_fsync", "read_cold", "read_warm", "memcpy_fresh", "memcpy_reused",
                                  "crc32c"}
    for name in SCENARIOS:
        entry = res["scenarios"][name]
        assert "error" not in entry, f"{name}: {entry.get('error')}"
        assert {"ours", "torch"} <= set(entry["variants"]), f"{name}: {sorted(entry['variants'])}"
        if name != "sync_save":
            assert all(entry["correct"].values()), f"{name}: wrong values loaded: {entry['correct']}"
    assert "ours_noverify" in res["scenarios"]["load_reshard_s0_s1"]["variants"]
    for name in ("load_same", "load_reshard_s0_s1"):  # the paired read limit: same files, same reps
        entry = res["scenarios"][name]
        assert entry["paired_limit_GiBps"] > 0 and entry["ours_vs_paired"] > 0, entry
        assert "ours vs the paired limit" in (out / "latest.md").read_text()
    # issue 33: CPU per GiB beside wall time, for ours, torch DCP and the paired raw limit
    save = res["scenarios"]["sync_save"]
    assert save["paired_limit_GiBps"] > 0 and save["ours_vs_paired"] > 0, save
    for name in ("sync_save", "load_same", "load_reshard_s0_s1"):
        for lib in ("ours", "torch", "raw"):
            cpu = res["scenarios"][name]["variants"][lib]["cpu_s_per_GiB"]["median"]
            assert cpu > 0 and math.isfinite(cpu), (name, lib, cpu)
        assert res["scenarios"][name]["ours_cpu_vs_paired"] > 0
    cpu_md = (out / "cpu_per_gib.md").read_text()
    assert cpu_md.startswith("# CPU per GiB") and "| 436 tensors | sync save (fsync) |" in cpu_md, cpu_md
    assert "FSDP2 + AdamW save" in cpu_md and "raw CPU s/GiB" in (out / "latest.md").read_text()
    issue33 = [t for t in doc["targets"] if t["issue"] == 33]
    assert len(issue33) == 17 and all(t["met"] is not None for t in issue33), issue33  # 3 of them async
    assert set(res["scenarios"]["reference"]["variants"]) == {
        "torch_save", "safetensors_save", "torch_load", "safetensors_load"}
    async_ = res["scenarios"]["async_save"]
    assert "error" not in async_, async_.get("error")
    assert "torch" in async_["variants"]
    assert async_["available"] == ("ours" in async_["variants"])
    for e in async_["variants"].values():  # compute lost per save: the call plus a share of the window
        assert e["lost_s"]["median"] is not None and math.isfinite(e["lost_s"]["median"])
    assert "compute lost s per save" in (out / "latest.md").read_text()
    assert res["offline"].get("available") or res["offline"].get("note")
    assert [p["ranks"] for p in res["planning"]["points"] if not p["extrapolated"]] == [16, 32]
    assert res["planning"]["target"]["ranks"] == 8192
    assert len(doc["targets"]) >= 10 and all("met" in t for t in doc["targets"])
    assert doc["machine"]["uptime_start"]
    assert not list(tmp_path.glob("hp-dcp-bench-*")), "the benchmark left its checkpoints behind"

    # issue 13: the many-tensor state dict, the model-shaped case, the replicated load, O_DIRECT
    many = res["many"]
    assert many["tensors"] == 436
    for name in ("sync_save", "load_same", "load_reshard_s0_s1"):
        entry = many["scenarios"][name]
        assert "error" not in entry, f"436 tensors, {name}: {entry.get('error')}"
        assert {"ours", "torch"} <= set(entry["variants"])
        if name != "sync_save":
            assert all(entry["correct"].values()), f"436 tensors, {name}: {entry['correct']}"
    for name in ("model_save", "model_load"):
        entry = res["model"][name]
        assert "error" not in entry, f"{name}: {entry.get('error')}"
        assert {"ours", "torch"} <= set(entry["variants"]) and entry["call_s"]["ours"]["values"]
    assert all(res["model"]["model_load"]["correct"].values()), res["model"]["model_load"]["correct"]
    hsdp = res["hsdp"]
    assert hsdp["world_size"] == 4 and hsdp["checkpoint_bytes"]["ours"] > 0
    for lib in ("ours", "ours_noshare", "torch"):
        reads = hsdp["reads"][lib]
        assert len(reads["per_rank"]) == 4 and reads["correct"], reads
        assert reads["asked_over_checkpoint"] > 0
    if "write_direct" in res["limits"]:  # O_DIRECT works on this filesystem
        assert "read_direct" in res["limits"]
        assert res["scenarios"]["sync_save"]["ours_vs_direct"] is not None
    issue13 = [t for t in doc["targets"] if t["issue"] == 13]
    assert len(issue13) == 16, [t["target"] for t in issue13]
    assert all(t["met"] is not None for t in issue13 if "baseline" not in t["target"]), [
        t for t in issue13 if t["met"] is None]

    # the report can be rebuilt from the JSON alone
    (out / "latest.md").unlink()
    proc = subprocess.run([*cmd[:2], "--render-only", "--out", str(out)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "latest.md").read_text().startswith("# DCP benchmark")


def test_quick_scale_benchmark_reports_every_case(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_scale.py"), "--quick", "--out", str(out),
           "--dir", str(tmp_path), "--cold", "fadvise"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"scale benchmark failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    doc = json.loads((out / "scale.json").read_text())
    assert (out / "scale.md").read_text().startswith("# Scale benchmark")

    pub = doc["public"]
    measured = [p for p in pub["points"] if not p["extrapolated"]]
    assert [p["ranks"] for p in measured] == [16]
    for p in measured:
        assert p["load_one_exact"] and p["load_rank_exact"], p
        assert p["transform_s"] > 0 and p["load_one_s"] > 0 and p["load_rank_s"] > 0
        assert p["files"] > 16 and p["metadata_bytes"] > 0 and p["load_rank_vmhwm"] > 0
    assert any(p["ranks"] == 4096 and p["extrapolated"] for p in pub["points"])
    for case in ("planning", "strided"):
        pts = [p for p in doc[case]["points"] if not p["extrapolated"]]
        assert [p["ranks"] for p in pts] == [16, 32], case
        for p in pts:
            assert p["load_reads"] > 0 and p["metadata_bytes"] > 0 and p["vmhwm"] > 0
            assert all(p[k] >= 0 for k in ("local_plan_s", "global_plan_s", "from_json_s", "load_plan_s"))
    assert doc["planning"]["target"]["ranks"] == 8192 and doc["planning"]["target"]["extrapolated"]
    assert len(doc["targets"]) == 10 and all(t["met"] is not None for t in doc["targets"]), doc["targets"]
    assert not list(tmp_path.glob("hp-dcp-scale-*")), "the benchmark left its checkpoints behind"


def test_warm_benchmark_checks_values_and_prints_both_libraries(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_warm.py"), "--size-mib", "4", "--layers", "2",
           "--reps", "1", "--dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| save |" in proc.stdout and "| load |" in proc.stdout, proc.stdout
    assert "values correct: ours True, torch DCP True" in proc.stdout, proc.stdout
    assert os.listdir(tmp_path) == [], "the benchmark left its checkpoints behind"


def test_gpu_staging_benchmark_runs_on_the_cpu_and_reports_every_way(tmp_path):
    """scripts/gpu_check.sh runs this benchmark on CUDA; here its CPU smoke run (the values
    of the last save of each way are loaded back and compared inside it)."""
    out = tmp_path / "gpu_staging.md"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu_staging.py"), "--device", "cpu",
           "--size-mb", "16", "--tensors", "4", "--reps", "2", "--compute-n", "64", "--compute-iters", "2",
           "--dir", str(tmp_path), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    report = out.read_text()
    for row in ("| ours eager |", "| ours, max_host_bytes=", "| torch DCP async_save |", "D2H into pageable"):
        assert row in report, (row, report)
    assert "staging buffers reused across saves (1 allocation): met" in report, report
    missing = subprocess.run([*cmd[:2], "--device", "cuda"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    if not torch_has_cuda():
        assert missing.returncode == 2 and "no cuda device here" in missing.stderr


def torch_has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def test_files_floor_benchmark_touches_every_data_file(tmp_path):
    import torch

    from hyper_parallel.core.distributed_checkpoint import Layout, offline_transform, save

    save({"w": torch.ones(16, 2)}, str(tmp_path / "one"), no_dist=True)
    offline_transform(str(tmp_path / "one"), str(tmp_path / "dp8"),
                      dst_layout={"*": Layout((8,), ("dp",))("dp", "None")})
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_files_floor.py"), str(tmp_path / "dp8"),
           "--threads", "1,2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.count("8 files") == 2 and "cold" in out and "warm" in out
    empty = subprocess.run([*cmd[:2], str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and "no .safetensors files" in empty.stderr
