"""The switch that makes our save write torch DCP's own format (issue 44 item 8): stock torch loads
it as its own, resharded, and our load reads it back directly; the other direction (torch writes,
ours loads) is test_torch_written_load.py."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as tdcp
from helpers import local_expected, make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import load, save
from hyper_parallel.core.distributed_checkpoint.filesystem import TorchFormatWriter


def rank_both_ways(rank: int, ws: int, root: str) -> dict:
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("x",))
    full, bias = make_tensor((9, 4)), make_tensor((5,), seed=3)
    sd = {"model": {"w": make_dtensor(full, mesh, [Shard(0)]), "b": bias.clone()}, "step": 11}
    save(sd, storage_writer=TorchFormatWriter(root))
    with open(os.path.join(root, ".metadata"), "rb") as f:
        pickled = f.read(1) == b"\x80"  # torch's pickled Metadata, not our JSON
    theirs = {"model": {"w": make_dtensor(torch.zeros(9, 4), mesh, [Shard(1)]), "b": torch.zeros(5)}, "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.load(theirs, checkpoint_id=root)  # stock torch, another layout
    ours = {"model": {"w": make_dtensor(torch.zeros(9, 4), mesh, [Replicate()]), "b": torch.zeros(5)}, "step": 0}
    load(ours, checkpoint_id=root)
    return {"pickled": pickled,
            "torch": torch.equal(theirs["model"]["w"].to_local(), local_expected(full, mesh, [Shard(1)]))
            and torch.equal(theirs["model"]["b"], bias) and theirs["step"] == 11,
            "ours": torch.equal(ours["model"]["w"].to_local(), full) and torch.equal(ours["model"]["b"], bias)
            and ours["step"] == 11}


def test_our_save_writes_a_checkpoint_stock_torch_loads_as_its_own(tmp_path):
    for out in run_ranks(rank_both_ways, 2, str(tmp_path / "ck")):
        assert out == {"pickled": True, "torch": True, "ours": True}
