"""Checkpoints of format version 1 (written by the release before version 2, committed as a
fixture) keep loading, resharding, verifying and converting bit-exact."""

from __future__ import annotations

import os
import shutil

import numpy as np
import torch
from helpers import assert_same, make_dtensor
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hyper_parallel.cli import main as cli
from hyper_parallel.core.distributed_checkpoint import (
    FileSystemReader,
    load,
    offline_transform,
    verify_checkpoint,
)
from hyper_parallel.core.distributed_checkpoint._src.engine.metadata_reader import read_checkpoint_metadata
from hyper_parallel.core.distributed_checkpoint._src.resharding.reshard import reshard

V1 = os.path.join(os.path.dirname(__file__), "..", "..", "..", "fixtures", "v1")


def expected() -> dict:
    e = torch.load(os.path.join(V1, "expected.pt"), weights_only=True)
    return {"model": {"w0": e["model.w0"], "w1": e["model.w1"], "rep": e["model.rep"], "ids": e["model.ids"]},
            "plain": e["plain"], "step": 42, "name": "v1-fixture", "betas": (0.9, 0.95), "blob": b"\x00v1\xff",
            "arr": np.arange(6, dtype=np.int16).reshape(2, 3)}


def test_a_v1_checkpoint_loads_bit_exact_in_one_process():
    meta = read_checkpoint_metadata(FileSystemReader(os.path.join(V1, "ckpt")))
    assert meta.version == 1
    assert_same(expected(), load(path=os.path.join(V1, "ckpt")))


def rank_loads_v1_resharded(rank: int, ws: int, path: str) -> bool:
    mesh = init_device_mesh("cpu", (ws,))
    e = expected()
    target = {"model": {k: make_dtensor(torch.zeros_like(v), mesh, [Shard(1 if v.dim() > 1 else 0)])
                        for k, v in e["model"].items()}}
    load(target, path, strict=False)
    for k, v in e["model"].items():
        want = make_dtensor(v, mesh, [Shard(1 if v.dim() > 1 else 0)]).to_local()
        assert torch.equal(target["model"][k].to_local(), want), k
    return True


def test_a_v1_checkpoint_loads_on_two_ranks_under_another_layout():
    assert run_ranks(rank_loads_v1_resharded, 2, os.path.join(V1, "ckpt")) == [True, True]


def test_a_v1_checkpoint_verifies_reshards_converts_and_inspects(tmp_path, capsys):
    src = os.path.join(V1, "ckpt")
    assert verify_checkpoint(src).ok
    reshard(src, str(tmp_path / "tp3"), dst_mesh={"dp": 3})
    assert_same(expected(), load(path=str(tmp_path / "tp3")))  # the result is format v2
    assert read_checkpoint_metadata(FileSystemReader(str(tmp_path / "tp3"))).version == 2
    assert verify_checkpoint(str(tmp_path / "tp3")).ok
    offline_transform(src, str(tmp_path / "t"), dst_layout={"dp": 4})
    assert_same(expected(), load(path=str(tmp_path / "t")))
    assert cli(["inspect", src]) == 0 and "format version 1" in capsys.readouterr().out


def test_a_flipped_byte_in_a_v1_data_file_is_still_detected(tmp_path):
    dst = str(tmp_path / "c")
    shutil.copytree(os.path.join(V1, "ckpt"), dst)
    name = sorted(f for f in os.listdir(dst) if f.endswith(".safetensors"))[0]
    size = os.path.getsize(os.path.join(dst, name))
    with open(os.path.join(dst, name), "r+b") as f:
        f.seek(size - 3)
        b = f.read(1)
        f.seek(size - 3)
        f.write(bytes([b[0] ^ 1]))
    assert not verify_checkpoint(dst).ok


def rank_saves_over(rank: int, ws: int, path: str) -> list[str]:
    mesh = init_device_mesh("cpu", (ws,))
    from hyper_parallel.core.distributed_checkpoint import save

    save({"w": make_dtensor(torch.arange(24.0).reshape(6, 4), mesh, [Shard(0)])}, path)
    return sorted(os.listdir(path))


def test_saving_over_a_v1_checkpoint_on_two_ranks_removes_its_files(tmp_path):
    # v1 file records name no writer: the ranks share the old files out among them
    path = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(V1, "ckpt"), path)
    old = {f for f in os.listdir(path) if f.startswith("data-")}
    listed = run_ranks(rank_saves_over, 2, path)
    left = {f for f in listed[0] if f.startswith("data-")}
    assert len(old) == 2 and not left & old and len(left) == 2, (old, left)
    assert torch.equal(load(path=path)["w"], torch.arange(24.0).reshape(6, 4))
    assert verify_checkpoint(path).unreferenced == []
