"""The chaos soak (benchmarks/bench_chaos.py) at CI size: a few faults of every kind, each
start's resume checked bit for bit. The full soak is opt-in (hundreds of faults, see README
"Reliability")."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_few_faults_lose_no_committed_step_load_no_wrong_value_and_hang_nowhere(tmp_path):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_chaos.py"), "--faults", "6", "--steps", "6",
           "--timeout", "5", "--kinds", "kill,storage,disk_full", "--seed", "3", "--json", str(out),
           "--work", str(tmp_path / "work")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"chaos soak failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    fig = doc["figures"]
    assert fig["faults_struck"] >= 6 and fig["resumes"] >= 6, fig
    assert (fig["committed_steps_lost"], fig["wrong_resumes"], fig["hangs"], fig["unclear_errors"],
            fig["unexpected_failures"]) == (0, 0, 0, 0, 0), fig
    runs = doc["runs"]
    assert runs[0]["fault"] is None and runs[0]["completed"] and runs[-1]["completed"]  # fault-free runs, checked
    assert "chaos soak:" in proc.stdout
