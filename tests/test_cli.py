"""The command line, run as a real subprocess."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from hyper_parallel.core.distributed_checkpoint import save


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hyper_parallel.core.distributed_checkpoint", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "c")
    save({"model": {"w": torch.randn(64, 32), "b": torch.zeros(5, dtype=torch.bfloat16)}, "step": 3}, path)
    return path


def _data_file(path: str) -> str:
    return os.path.join(path, next(f for f in os.listdir(path) if f.endswith(".safetensors")))


def test_inspect_lists_every_key_with_totals(ckpt):
    out = run("inspect", ckpt)
    assert out.returncode == 0, out.stderr
    for key in ("model.w", "model.b", "step", "bfloat16", "64x32"):
        assert key in out.stdout
    doc = json.loads(run("inspect", ckpt, "--json").stdout)
    assert {e["key"] for e in doc["entries"]} == {"model.w", "model.b", "step"}
    assert doc["totals"]["bytes"] == 64 * 32 * 4 + 5 * 2


def test_verify_passes_a_good_checkpoint(ckpt):
    out = run("verify", ckpt)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stdout + out.stderr


@pytest.mark.parametrize("where", ["data", "header"])
def test_verify_fails_on_one_flipped_byte(ckpt, where):
    path = _data_file(ckpt)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100 if where == "data" else 20)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x04]))
    out = run("verify", ckpt, "--json")
    assert out.returncode == 1
    assert json.loads(out.stdout)["problems"]


def test_verify_fails_on_a_missing_data_file(ckpt):
    os.unlink(_data_file(ckpt))
    out = run("verify", ckpt)
    assert out.returncode == 1 and "missing" in out.stdout


def test_a_path_that_is_not_a_checkpoint_is_a_clear_error(tmp_path):
    out = run("inspect", str(tmp_path))
    assert out.returncode == 2 and "not a checkpoint" in out.stderr
    # gc of a path that is no directory had reported "removed 0" and exit 0
    (tmp_path / "f").write_text("x")
    for path in (str(tmp_path / "no" / "such"), str(tmp_path / "f")):
        out = run("gc", path)
        assert out.returncode == 2 and "is not a directory" in out.stderr, out
    # import of a missing or non-torch file had said it "holds arbitrary pickled objects"
    (tmp_path / "text.pt").write_text("just text\n")
    out = run("import-hf", str(tmp_path / "missing.pt"), str(tmp_path / "o"))
    assert out.returncode == 2 and "no such file" in out.stderr and "pickle" not in out.stderr, out
    out = run("import-hf", str(tmp_path / "text.pt"), str(tmp_path / "o"))
    assert out.returncode == 2 and "not a checkpoint this tool reads" in out.stderr and "pickle" not in out.stderr
    torch.save({"w": torch.ones(2), "opt": object.__new__(argparse.Namespace)}, str(tmp_path / "pickled.pt"))
    out = run("import-hf", str(tmp_path / "pickled.pt"), str(tmp_path / "o"))
    assert out.returncode == 2 and "allow_pickle" in out.stderr, out


def test_inspect_and_gc_read_urls(s3_endpoint, monkeypatch):
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="cli-urls")
    save({"w": torch.ones(4)}, "s3://cli-urls/ck")
    s3.put_object(Bucket="cli-urls", Key="ck/data-r00000-0-0123456789abcdef.safetensors", Body=b"x")
    out = run("inspect", "s3://cli-urls/ck")
    assert out.returncode == 0 and "float32" in out.stdout, out
    out = run("gc", "s3://cli-urls/ck")  # newer than .metadata: a save in progress may commit it
    assert out.returncode == 0 and "removed 0 " in out.stdout and "left 1 " in out.stdout, out
    out = run("gc", "s3://cli-urls/ck", "--min-age", "0")  # the operator says no save runs there
    assert out.returncode == 0 and "removed 1 " in out.stdout, out
    names = [o["Key"] for o in s3.list_objects_v2(Bucket="cli-urls")["Contents"]]
    assert "ck/data-r00000-0-0123456789abcdef.safetensors" not in names and "ck/.metadata" in names


def test_transform_export_and_import_round_trip(ckpt, tmp_path):
    out = run("transform", ckpt, str(tmp_path / "t"), "--mesh", "tp=2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["keys"] == 3
    out = run("export-hf", str(tmp_path / "t"), str(tmp_path / "hf"), "--prefix", "model.")
    assert out.returncode == 0, out.stderr
    assert os.path.exists(tmp_path / "hf" / "model.safetensors")
    out = run("import-hf", str(tmp_path / "hf"), str(tmp_path / "back"), "--prefix", "model.")
    assert out.returncode == 0, out.stderr
    from hyper_parallel.core.distributed_checkpoint import load
    a, b = load(path=ckpt), load(path=str(tmp_path / "back"))
    assert torch.equal(a["model"]["w"], b["model"]["w"]) and torch.equal(a["model"]["b"], b["model"]["b"])
    again = run("transform", ckpt, str(tmp_path / "t"), "--mesh", "tp=2")
    assert again.returncode == 2 and "already holds a checkpoint" in again.stderr
    twice = run("transform", ckpt, str(tmp_path / "t2"), "--mesh", "dp=2,dp=4")  # the last one had won, silently
    assert twice.returncode == 2 and "names the dim 'dp' twice" in twice.stderr, twice.stderr
    assert not os.path.exists(tmp_path / "t2" / ".metadata")


def test_import_torch_dcp_requires_trust(tmp_path):
    out = run("import-torch-dcp", str(tmp_path), str(tmp_path / "x"))
    assert out.returncode == 2 and "--trust" in out.stderr


MS_FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "mindspore")


def test_import_and_export_mindspore(tmp_path):
    tp2 = os.path.join(MS_FIX, "tp2")
    out = run("import-mindspore", tp2, str(tmp_path / "dcp"), "--strategy", os.path.join(tp2, "strategy.ckpt"),
              "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["keys"] == 10
    out = run("export-mindspore", str(tmp_path / "dcp"), str(tmp_path / "m.st"), "--format", "safetensors", "--crc")
    assert out.returncode == 0, out.stderr
    assert "(safetensors): 10 values" in out.stdout
    from hyper_parallel.core.distributed_checkpoint import read_mindspore_checkpoint
    a = read_mindspore_checkpoint(os.path.join(tp2, "full.ckpt"))
    b = read_mindspore_checkpoint(str(tmp_path / "m.st"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_import_mindspore_errors_are_one_clear_line(tmp_path):
    out = run("import-mindspore", os.path.join(MS_FIX, "encrypted.ckpt"), str(tmp_path / "x"))
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "encrypted MindSpore" in out.stderr


def test_ls_does_not_call_files_a_committed_step_uses_debris(tmp_path):
    from hyper_parallel.core.distributed_checkpoint import CheckpointManager

    d = str(tmp_path / "run")
    with CheckpointManager(d, incremental=True, keep_latest=1) as mgr:  # step 2 reuses step 1's "w"
        mgr.save(1, {"w": torch.ones(100), "v": torch.zeros(10)})
        mgr.save(2, {"w": torch.ones(100), "v": torch.ones(10)})
    out = run("ls", d)
    assert out.returncode == 0, out.stderr
    assert "files in use" in out.stdout and "do not delete" in out.stdout and "debris" not in out.stdout


def test_gc_of_a_retired_step_keeps_the_files_a_committed_step_reads(tmp_path):
    # gc of the step ls says not to delete had removed the chunk committed step 2 reads from it
    from hyper_parallel.core.distributed_checkpoint import CheckpointError, CheckpointManager, load

    d = str(tmp_path / "run")
    with CheckpointManager(d, incremental=True, keep_latest=1) as mgr:  # step 2 reuses step 1's "w"
        mgr.save(1, {"w": torch.ones(100), "v": torch.zeros(10)})
        mgr.save(2, {"w": torch.ones(100), "v": torch.ones(10)})
    step1 = os.path.join(d, "step_00000001")
    kept = sorted(os.listdir(step1))
    assert kept and ".metadata" not in kept
    debris = "data-r00003-0-00ff.safetensors"
    with open(os.path.join(step1, debris), "wb") as f:
        f.write(b"x")
    out = run("gc", step1, "--min-age", "0")  # (no .metadata: only debris this old goes)
    assert out.returncode == 0, out.stderr
    assert sorted(os.listdir(step1)) == kept and "removed 1 " in out.stdout  # only the debris went
    # other names of the step: the step was not recognised, and every file went
    alias = str(tmp_path / "alias")
    os.symlink(step1, alias)
    for args, cwd in (((step1 + "/.",), None), ((alias,), None), ((".",), step1)):
        out = subprocess.run([sys.executable, "-m", "hyper_parallel.core.distributed_checkpoint", "gc", *args],
                             capture_output=True, text=True, timeout=120, cwd=cwd)
        assert out.returncode == 0 and "removed 0 " in out.stdout, (args, out.stdout, out.stderr)
        assert sorted(os.listdir(step1)) == kept
    assert torch.equal(load(path=os.path.join(d, "step_00000002"))["w"], torch.ones(100))
    # the step directory a symlink to another volume: its siblings are beside the link
    vol = tmp_path / "vol"
    vol.mkdir()
    os.rename(step1, vol / "step_00000001")
    os.symlink(vol / "step_00000001", step1)
    out = run("gc", step1)
    assert out.returncode == 0 and "removed 0 " in out.stdout, out.stdout + out.stderr
    # ...but a load never follows a linked step directory (issue 30: it could lead anywhere)
    with pytest.raises(CheckpointError, match="step_00000001/data-.*symbolic link"):
        load(path=os.path.join(d, "step_00000002"))
    with open(os.path.join(d, "step_00000002", ".metadata"), "r+b") as f:  # unreadable: refuse, delete nothing
        f.write(b"garbage")
    out = run("gc", step1)
    assert out.returncode != 0 and "other steps use" in (out.stderr + out.stdout)
    assert sorted(os.listdir(step1)) == kept


def test_cli_errors_name_the_flag_not_the_keyword(tmp_path):
    full = os.path.join(MS_FIX, "tp2", "full.ckpt")
    assert run("import-mindspore", full, str(tmp_path / "dcp")).returncode == 0
    out = run("import-mindspore", full, str(tmp_path / "dcp"))
    assert out.returncode == 2 and "--overwrite" in out.stderr and "overwrite=True" not in out.stderr


def test_ls_lists_the_steps_of_a_manager_directory_committed_or_not(tmp_path):
    from hyper_parallel.core.distributed_checkpoint import CheckpointManager

    d = str(tmp_path / "run")
    with CheckpointManager(d) as mgr:
        mgr.save(10, {"w": torch.zeros(100)}, metrics={"loss": 0.25, "acc": float("nan")})
        mgr.save(20, {"w": torch.zeros(100)})
    os.makedirs(os.path.join(d, "step_00000030"))  # a crashed save: data, no .metadata
    with open(os.path.join(d, "step_00000030", "data-r00000-0-00ff.safetensors"), "wb") as f:
        f.write(b"x" * 10)
    out = run("ls", d)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["step", "state", "files", "size", "metrics", "references"]
    assert "committed" in lines[1] and "loss=0.25" in lines[1] and "acc=nan" in lines[1]
    assert lines[2].startswith("20 (latest)") and "uncommitted" in lines[3]
    doc = json.loads(run("ls", d, "--json").stdout)
    assert doc["latest_committed"] == 20
    assert [(s["step"], s["state"], s["files"]) for s in doc["steps"]] == [
        (10, "committed", 2), (20, "committed", 2), (30, "uncommitted", 1)]
    assert doc["steps"][0]["metrics"] == {"loss": 0.25, "acc": "nan"} and doc["steps"][0]["references"] == []
    assert run("ls", str(tmp_path / "missing")).returncode == 2


def _rank_local_save(rank: int, ws: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    save({"w": distribute_tensor(torch.arange(64.0).reshape(8, 8), mesh, [Shard(0)])}, checkpoint_id=path,
         use_collectives=False)


def test_gc_keeps_every_file_a_rank_local_checkpoint_names(tmp_path):
    from multiprocess import run_ranks

    from hyper_parallel.core.distributed_checkpoint import load

    path = str(tmp_path / "local")
    run_ranks(_rank_local_save, 2, path)
    data = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    assert len(data) == 2 and not os.path.exists(os.path.join(path, ".metadata"))
    debris = "data-r00007-0-00ff.safetensors"
    with open(os.path.join(path, debris), "wb") as f:
        f.write(b"x")
    out = run("gc", path, "--min-age", "0")  # (written after the fragments: only this old goes)
    assert out.returncode == 0, out.stderr
    assert sorted(n for n in os.listdir(path) if n.endswith(".safetensors")) == data  # only the debris went
    assert torch.equal(load(path=path)["w"], torch.arange(64.0).reshape(8, 8))
    os.remove(os.path.join(path, ".metadata-r00001"))  # a fragment missing: refuse, delete nothing
    out = run("gc", path)
    assert out.returncode != 0 and "fragment" in (out.stderr + out.stdout)
    assert sorted(n for n in os.listdir(path) if n.endswith(".safetensors")) == data


def test_verify_of_a_format_v1_checkpoint_reports_no_debris():
    fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "v1", "ckpt")
    out = run("verify", fixture)
    assert out.returncode == 0, out.stderr
    assert "unreferenced" not in out.stdout


def test_transform_stores_tiny_shards_as_chunks_of_several_ranks(ckpt, tmp_path):
    from hyper_parallel.core.distributed_checkpoint import FileSystemReader, Layout, load, save_layout
    from hyper_parallel.core.distributed_checkpoint._src.engine.metadata_reader import read_checkpoint_metadata

    strategy = str(tmp_path / "dp8.json")
    save_layout({"model.w": Layout((8,), ("dp",))("dp", "None")}, strategy)
    out = run("transform", ckpt, str(tmp_path / "t"), "--layout", strategy, "--min-chunk-bytes", "4096", "--json")
    assert out.returncode == 0, out.stderr
    meta = read_checkpoint_metadata(FileSystemReader(str(tmp_path / "t")))
    # 8 rows of 128 bytes a rank: 4 ranks' rows make a 4 KiB chunk, written by ranks 0 and 4
    assert meta.entries["model.w"].store.layout["rank_list"] == [0, 4]
    assert meta.entries["model.w"].layout["mesh_shape"] == [8]
    a, b = load(path=ckpt), load(path=str(tmp_path / "t"))
    assert torch.equal(a["model"]["w"], b["model"]["w"]) and torch.equal(a["model"]["b"], b["model"]["b"])
