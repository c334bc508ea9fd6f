"""export_torch_dcp: our checkpoint -> a checkpoint torch.distributed.checkpoint loads as its own."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as tdcp
from helpers import assert_same, bits, local_expected, make_dtensor, make_tensor, payload_start
from multiprocess import run_ranks
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel.cli import main
from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    UnsupportedValueError,
    export_torch_dcp,
    import_torch_dcp,
    load,
    save,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

# DTensors: name -> (shape, dtype, seed), saved as Shard(0) (REPLICATED: as Replicate()).
# Sizes are uneven on 2 ranks in both dims.
SHARDED = {"w": ((9, 6), torch.float32, 0), "emb": ((7, 5), torch.bfloat16, 1),
           "f8": ((5, 3), torch.float8_e4m3fn, 2), "idx": ((3, 7), torch.int64, 3),
           "rep": ((4, 5), torch.float32, 4)}
REPLICATED = {"rep"}


def special_floats(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0])
    return t


def full_of(name: str) -> torch.Tensor:
    shape, dtype, seed = SHARDED[name]
    t = make_tensor(shape, dtype, seed)
    return special_floats(t) if dtype == torch.float32 else t


PLAIN = {"model": {"bias": make_tensor((6,), seed=10), "scale": torch.tensor(2.5, dtype=torch.float64)},
         "step": 1234, "lr": 3e-4, "done": False, "name": "run-α", "none": None, "blob": b"\x00\xffraw",
         "arr": np.arange(12, dtype=np.int16).reshape(3, 4),
         "extra": {"betas": (0.9, 0.999), "milestones": [10, 20], "nested": {"depth": 2, 7: "int key"}}}


def rank_save_ours(rank: int, ws: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    sd = {"model": {k: make_dtensor(full_of(k), mesh, [Replicate() if k in REPLICATED else Shard(0)])
                    for k in SHARDED}}
    sd["model"].update(PLAIN["model"])
    sd.update({k: v for k, v in PLAIN.items() if k != "model"})
    save(sd, path, sync_files=False)


def rank_torch_load(rank: int, ws: int, path: str) -> None:
    """torch's own dcp.load into Shard(1) DTensors (saved as Shard(0)), nested non-tensors."""
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    target = {"model": {k: make_dtensor(torch.zeros(s, dtype=d), mesh, [Shard(1)]) for k, (s, d, _) in SHARDED.items()},
              "step": None, "lr": None, "done": None, "name": None, "none": 0, "blob": None, "arr": None,
              "extra": {"betas": None, "milestones": None, "nested": {"depth": None, 7: None}}}
    target["model"].update({"bias": torch.zeros(6), "scale": torch.zeros((), dtype=torch.float64)})
    tdcp.load(target, checkpoint_id=path)
    for k in SHARDED:
        got = target["model"][k]
        assert got.placements == (Shard(1),)
        want = local_expected(full_of(k), mesh, [Shard(1)])
        assert got.to_local().dtype == want.dtype and torch.equal(bits(got.to_local()), bits(want)), k
    assert_same(PLAIN["model"], {k: target["model"][k] for k in PLAIN["model"]})
    plain = {k: v for k, v in PLAIN.items() if k != "model"}
    # torch's flattening keys nested dicts by str(key): an int key comes back as its string,
    # as it does from torch's own dcp.save
    plain["extra"]["nested"] = {"depth": 2, 7: None, "7": "int key"}
    assert_same(plain, {k: target[k] for k in plain})


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> str:
    """Our checkpoint saved by 2 gloo ranks with Shard(0), plus plain values of every kind."""
    path = str(tmp_path_factory.mktemp("ours") / "ckpt")
    run_ranks(rank_save_ours, 2, path)
    return path


def test_torch_dcp_loads_the_export_bit_exact_on_two_ranks_under_another_layout(sharded, tmp_path):
    dst = str(tmp_path / "torch")
    tmeta = export_torch_dcp(sharded, dst)
    # the saved layout's boxes became torch's chunks, in the file of the rank that held each
    w = tmeta.state_dict_metadata["model.w"]
    assert isinstance(w, TensorStorageMetadata) and w.size == torch.Size([9, 6])
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in w.chunks] == [((0, 0), (5, 6)), ((5, 0), (4, 6))]
    assert len({tmeta.storage_data[i].relative_path for i in tmeta.storage_data if i.fqn == "model.w"}) == 2
    assert isinstance(tmeta.state_dict_metadata["blob"], BytesStorageMetadata)
    assert tmeta.planner_data["extra.nested.depth"] == ("extra", "nested", "depth")
    rep = tmeta.state_dict_metadata["model.rep"]
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in rep.chunks] == [((0, 0), (4, 5))]  # one replica
    run_ranks(rank_torch_load, 2, dst)


def rank_save_empty_dtensors(rank: int, ws: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    save({"w": make_dtensor(full_of("w"), mesh, [Shard(0)]),
          "empty": make_dtensor(torch.zeros(0, 4), mesh, [Shard(0)]),
          "no_cols": make_dtensor(torch.zeros(3, 0, dtype=torch.bfloat16), mesh, [Shard(1)])}, path, sync_files=False)


def test_an_empty_dtensor_is_exported_as_torch_writes_it(tmp_path):
    """A DTensor with no elements has no non-empty box in its layout; it still gets torch's one
    empty chunk (it was dropped, and torch's dcp.load of the export then missed the key)."""
    src, dst = str(tmp_path / "ours"), str(tmp_path / "torch")
    run_ranks(rank_save_empty_dtensors, 2, src)
    tmeta = export_torch_dcp(src, dst)
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in tmeta.state_dict_metadata["empty"].chunks] == [((0, 0), (0, 4))]
    assert tmeta.state_dict_metadata["no_cols"].size == torch.Size([3, 0])
    target = {"w": torch.zeros(9, 6), "empty": torch.ones(0, 4), "no_cols": torch.ones(3, 0, dtype=torch.bfloat16)}
    tdcp.load(target, checkpoint_id=dst, no_dist=True)
    assert torch.equal(bits(target["w"]), bits(full_of("w")))
    assert target["empty"].shape == (0, 4) and target["no_cols"].dtype == torch.bfloat16


def test_one_process_torch_load_and_dcp_to_torch_save_rebuild_the_state(sharded, tmp_path):
    dst = str(tmp_path / "torch")
    export_torch_dcp(sharded, dst)
    target = {"model": {k: torch.zeros(s, dtype=d) for k, (s, d, _) in SHARDED.items()},
              "step": 0, "name": "", "extra": {"betas": None, "nested": {"depth": 0}}}
    tdcp.load(target, checkpoint_id=dst, no_dist=True)
    for k in SHARDED:
        assert torch.equal(bits(target["model"][k]), bits(full_of(k))), k
    assert (target["step"], target["name"], target["extra"]) == (1234, "run-α", {"betas": (0.9, 0.999),
                                                                                 "nested": {"depth": 2}})
    # no target at all: torch rebuilds the nested dict from planner_data
    dcp_to_torch_save(dst, str(tmp_path / "full.pt"))
    whole = torch.load(str(tmp_path / "full.pt"), weights_only=False)
    want = {"model": {**{k: full_of(k) for k in SHARDED}, **PLAIN["model"]},
            **{k: v for k, v in PLAIN.items() if k != "model"}}
    want["extra"] = {**want["extra"], "nested": {"depth": 2, "7": "int key"}}
    assert_same(want, whole)


def test_metadata_is_what_torch_dcp_save_writes_for_the_same_state_dict(tmp_path):
    sd = {"model": {"w": make_tensor((4, 3)), "empty": torch.empty(0, 3), "s": torch.tensor(1, dtype=torch.int32)},
          "opt": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
          "lst": [make_tensor((2,), seed=1), {"k": 1}], "tup": (make_tensor((2,), seed=2), 5),
          "ints": [1, 2], "unused": {}, "blob": b"x"}
    save(sd, str(tmp_path / "ours"), no_dist=True)
    mine = export_torch_dcp(str(tmp_path / "ours"), str(tmp_path / "export"))
    tdcp.save(sd, checkpoint_id=str(tmp_path / "native"), no_dist=True)
    native = tdcp.FileSystemReader(str(tmp_path / "native")).read_metadata()
    assert mine.planner_data == native.planner_data
    assert mine.state_dict_metadata == native.state_dict_metadata
    assert mine.version == native.version
    assert {(i.fqn, i.offset) for i in mine.storage_data} == {(i.fqn, i.offset) for i in native.storage_data}


def test_round_trip_through_import_torch_dcp_is_bit_exact(tmp_path):
    sd = {"model": {"w": special_floats(make_tensor((33, 17))), "h": make_tensor((8,), torch.float16, 1),
                    "n": make_tensor((4, 4), torch.int32, 2)},
          "step": 9, "name": "x", "cfg": {"lr": 0.5, "betas": (0.9, 0.95), "sizes": [1, 2, 3]},
          "blob": b"\x00hi", "arr": np.arange(5, dtype=np.int16)}  # the import had refused these two
    save(sd, str(tmp_path / "ours"), no_dist=True)
    export_torch_dcp(str(tmp_path / "ours"), str(tmp_path / "torch"), max_chunk_bytes=200)
    import_torch_dcp(str(tmp_path / "torch"), str(tmp_path / "back"), trust=True)
    assert_same(sd, load(path=str(tmp_path / "back")))
    target = {"model": {"w": torch.zeros(33, 17), "h": torch.zeros(8, dtype=torch.float16),
                        "n": torch.zeros(4, 4, dtype=torch.int32)},
              "step": 0, "name": "", "cfg": {"lr": 0.0, "betas": (0.0, 0.0), "sizes": []},
              "blob": b"", "arr": np.zeros(5, dtype=np.int16)}
    load(target, str(tmp_path / "back"))  # "cfg" was stored split, key by key: put together again
    assert_same(sd, target)


def test_a_torch_training_checkpoint_imported_resumes_into_the_same_target(tmp_path):
    # torch stores plain dicts and param_groups key by key; a target holding them whole was
    # refused (strict) or silently kept its own step and learning rate (strict=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.25, betas=(0.8, 0.9))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"step": 7, "a": {"b": [1, 2]}}}
    tdcp.save(sd, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    import_torch_dcp(str(tmp_path / "torch"), str(tmp_path / "ours"), trust=True)
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh(torch.ones(2, 4)).sum().backward()
    fresh_opt.step()
    target = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict(), "extra": {"step": 0, "a": {"b": []}}}
    load(target, str(tmp_path / "ours"))
    assert target["extra"] == {"step": 7, "a": {"b": [1, 2]}}
    group = target["optim"]["param_groups"][0]
    assert group["lr"] == 0.25 and tuple(group["betas"]) == (0.8, 0.9) and group["params"] == [0, 1]
    for k, v in sd["optim"]["state"][0].items():
        assert torch.equal(target["optim"]["state"][0][k], v), k
    fresh_opt.load_state_dict(target["optim"])
    assert fresh_opt.param_groups[0]["lr"] == 0.25
    assert load(path=str(tmp_path / "ours"))["optim"]["param_groups"][0]["lr"] == 0.25  # a list, as saved


def test_large_boxes_are_cut_into_chunks_of_at_most_max_chunk_bytes(tmp_path):
    w = make_tensor((50, 8))
    save({"w": w}, str(tmp_path / "ours"), no_dist=True)
    seen: list[int] = []
    tmeta = export_torch_dcp(str(tmp_path / "ours"), str(tmp_path / "torch"), max_chunk_bytes="320B",
                             progress=seen.append)
    chunks = tmeta.state_dict_metadata["w"].chunks
    assert len(chunks) == 5 and all(c.sizes == torch.Size([10, 8]) for c in chunks)
    assert sum(seen) == w.numel() * 4
    out = {"w": torch.zeros(50, 8)}
    tdcp.load(out, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    assert torch.equal(out["w"], w)


def test_existing_checkpoints_are_kept_until_the_new_export_commits(sharded, tmp_path):
    dst = str(tmp_path / "torch")
    export_torch_dcp(sharded, dst)
    first = sorted(os.listdir(dst))
    with pytest.raises(CheckpointError, match="overwrite=True"):
        export_torch_dcp(sharded, dst)
    with pytest.raises(CheckpointError, match="source"):
        export_torch_dcp(sharded, sharded, overwrite=True)
    # a source byte flipped in one rank's file: the export fails (while the other file is being
    # written by another thread), the old export stays whole, no debris
    src = str(tmp_path / "bad")
    shutil.copytree(sharded, src)
    data = next(os.path.join(src, f) for f in os.listdir(src) if f.startswith("data-r00001"))
    with open(data, "rb") as f:  # the first tensor payload of that file, from its own header
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    name = next(k for k in header if "@" in k)
    start = payload_start(data, name)
    with open(data, "r+b") as f:
        f.seek(start)
        b = f.read(1)
        f.seek(start)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        export_torch_dcp(src, dst, overwrite=True)
    assert sorted(os.listdir(dst)) == first
    target = {"step": None}
    tdcp.load(target, checkpoint_id=dst, no_dist=True)
    assert target["step"] == 1234
    with pytest.raises(CorruptCheckpointError):
        export_torch_dcp(src, str(tmp_path / "fresh"))
    assert os.listdir(tmp_path / "fresh") == []
    # a successful overwrite replaces the old files
    export_torch_dcp(str(tmp_path / "bad"), dst, overwrite=True, verify=False)
    assert not (set(first) - {".metadata"}) & set(os.listdir(dst))


def test_pickled_values_need_allow_pickle(tmp_path):
    when = datetime.date(2020, 1, 2)
    save({"when": when, "w": make_tensor((2,))}, str(tmp_path / "ours"), no_dist=True, allow_pickle=True)
    with pytest.raises(UnsupportedValueError, match="allow_pickle"):
        export_torch_dcp(str(tmp_path / "ours"), str(tmp_path / "torch"))
    assert not os.path.exists(tmp_path / "torch" / ".metadata")
    export_torch_dcp(str(tmp_path / "ours"), str(tmp_path / "torch"), allow_pickle=True)
    target = {"when": None}
    tdcp.load(target, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    assert target["when"] == when


def test_cli_export_torch_dcp(sharded, tmp_path, capsys):
    dst = str(tmp_path / "torch")
    out = subprocess.run([sys.executable, "-m", "hyper_parallel.core.distributed_checkpoint", "export-torch-dcp",
                          sharded, dst, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["command"] == "export-torch-dcp" and info["files"] == 2
    assert info["keys"] == len(SHARDED) + len(PLAIN["model"]) + 11
    # the rest in-process (same entry point, without another torch import)
    assert main(["export-torch-dcp", sharded, dst]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert main(["export-torch-dcp", sharded, dst, "--overwrite", "--max-chunk-size", "64B"]) == 0
    assert "export-torch-dcp ->" in capsys.readouterr().out
    assert len([f for f in os.listdir(dst) if f.endswith(".distcp")]) == 2
    target = {"model": {"w": torch.zeros(9, 6)}}
    tdcp.load(target, checkpoint_id=dst, no_dist=True)
    assert torch.equal(bits(target["model"]["w"]), bits(full_of("w")))


def test_importing_many_tensors_loads_them_in_batches(tmp_path, monkeypatch):
    # torch's load unpickles .metadata on every call: one call per tensor made an import of
    # 1000 tensors take 44 s (0.7 s in batches)
    import importlib

    import torch.distributed.checkpoint as tdcp

    ot = importlib.import_module(
        "hyper_parallel.core.distributed_checkpoint._src.interop.torch.importing")  # the module

    sd = {f"layers.{i}.bias": torch.full((5,), float(i)) for i in range(200)}
    sd["big"] = torch.arange(6000, dtype=torch.float32)
    tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(str(tmp_path / "tdcp")), no_dist=True)
    calls = []
    real = tdcp.load
    monkeypatch.setattr(tdcp, "load", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(ot, "IMPORT_BATCH_BYTES", 16 << 10)  # the big tensor makes a batch of its own
    import_torch_dcp(str(tmp_path / "tdcp"), str(tmp_path / "ours"), trust=True)
    assert len(calls) <= 4, len(calls)
    out = load(path=str(tmp_path / "ours"))
    assert sorted(out) == sorted(sd) and all(torch.equal(out[k], v) for k, v in sd.items())


def test_exporting_or_importing_onto_the_source_is_refused_even_through_a_symlink(tmp_path):
    # the export compared abspath only (an alias replaced our checkpoint with torch's and lost
    # the data); the import had no guard at all
    sd = {"w": make_tensor((4, 4))}
    save(sd, str(tmp_path / "ours"), no_dist=True)
    os.symlink(tmp_path / "ours", tmp_path / "alias")
    with pytest.raises(CheckpointError, match="is the source checkpoint"):
        export_torch_dcp(str(tmp_path / "ours"), str(tmp_path / "alias"), overwrite=True)
    assert_same(sd, load(path=str(tmp_path / "ours")))
    tdcp.save(sd, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    with pytest.raises(ValueError, match="is the source checkpoint"):
        import_torch_dcp(str(tmp_path / "torch"), str(tmp_path / "torch"), trust=True, overwrite=True)
    out = {"w": torch.zeros(4, 4)}
    tdcp.load(out, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    assert torch.equal(out["w"], sd["w"])
