"""The chaos soak (benchmarks/bench_chaos.py) at CI size: a few faults, each start's resume
checked bit for bit, the state partly written behind torch's version counter (``.data`` and
numpy views, sparse writes of the tensors that never change otherwise), and the first two
faults a flipped bit in a local-tier copy (its header, then a payload). The full soak is
opt-in (hundreds of faults, see README "Reliability")."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_few_faults_lose_no_committed_step_load_no_wrong_value_and_hang_nowhere(tmp_path):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_chaos.py"), "--faults", "6", "--steps", "6",
           "--timeout", "5", "--kinds", "kill,storage,disk_full", "--seed", "3", "--json", str(out),
           "--first", "local_bitflip:header,local_bitflip:payload", "--work", str(tmp_path / "work")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"chaos soak failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    fig = doc["figures"]
    assert fig["faults_struck"] >= 6 and fig["resumes"] >= 6, fig
    assert (fig["committed_steps_lost"], fig["wrong_resumes"], fig["wrong_committed_steps"], fig["hangs"],
            fig["unclear_errors"], fig["unexpected_failures"]) == (0, 0, 0, 0, 0, 0), fig
    runs = doc["runs"]
    assert runs[0]["fault"] is None and runs[0]["completed"] and runs[-1]["completed"]  # fault-free runs, checked
    # writes behind the counter happened (steps 1-12, the fault-free runs, hold both kinds and sparse writes)
    assert all(fig["writes_behind_counter"].get(p, 0) > 0 for p in ("data", "numpy", "sparse")), fig
    # the flipped header is always seen (every header is read when the directories are listed): that copy
    # was left out and the right values loaded from another
    assert fig["local_bitflips"] == 2 and fig["local_bitflips_detected"]["header"] == 1, fig
    assert fig["resumes_after_refused_copy"] >= 1, fig
    assert "chaos soak:" in proc.stdout and "local-tier bit flips 2" in proc.stdout
