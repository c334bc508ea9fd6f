"""A rank killed during a torch-style (rank-local) overwrite never leaves a mix that loads.

Two gloo ranks save A with ``use_collectives=False``, then B over it; rank 1 is killed with
``os._exit`` inside its save (after rank 0 committed B's fragment), so no ``except`` runs.
Rank 0's fragment is then B's and rank 1's A's: the directory must refuse to load (naming
the rank), never hand out half A, half B (issue 42, item 8).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from multiprocess import RankFailure, run_ranks

from hyper_parallel.core.distributed_checkpoint import MetadataError, load, save
from hyper_parallel.core.distributed_checkpoint._src.backends.filesystem import FileSystemWriter

A = torch.arange(64.0).reshape(8, 8)


class DiesAfterRankZeroCommits(FileSystemWriter):
    """Rank 1's writer: waits until rank 0's fragment changed (its B is committed), then dies
    mid-write, as a killed process does."""

    def __init__(self, path: str, rank0_before: bytes):
        super().__init__(path)
        self.rank0_before = rank0_before

    def write_file(self, name, parts):
        frag = os.path.join(self.path, ".metadata-r00000")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(frag, "rb") as f:
                if f.read() != self.rank0_before:
                    break
            time.sleep(0.01)
        os._exit(17)


def _save(rank: int, ws: int, path: str, value: torch.Tensor, rank0_before: bytes | None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    writer = DiesAfterRankZeroCommits(path, rank0_before) if rank == 1 and rank0_before is not None else None
    save({"w": distribute_tensor(value, mesh, [Shard(0)])}, checkpoint_id=path, storage_writer=writer,
         use_collectives=False)


def test_a_rank_killed_during_a_rank_local_overwrite_leaves_no_loadable_mix(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save, 2, path, A, None)
    assert torch.equal(load(path=path)["w"], A)
    with open(os.path.join(path, ".metadata-r00000"), "rb") as f:
        rank0_a = f.read()
    with pytest.raises(RankFailure, match="exited with code 17"):
        run_ranks(_save, 2, path, -A, rank0_a)
    with open(os.path.join(path, ".metadata-r00000"), "rb") as f:
        assert f.read() != rank0_a  # rank 0 committed B; rank 1 still holds A's fragment
    with pytest.raises(MetadataError, match=r"rank\(s\) \[1\]"):
        load(path=path)
    # a save from every rank afterwards makes one checkpoint again
    run_ranks(_save, 2, path, A * 2, None)
    assert torch.equal(load(path=path)["w"], A * 2)


def test_a_rank_local_save_over_a_damaged_fragment_overwrites_it(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save, 2, path, A, None)
    with open(os.path.join(path, ".metadata-r00001"), "wb") as f:
        f.write(b"{damaged")
    run_ranks(_save, 2, path, -A, None)  # not refused for the fragment it replaces
    assert torch.equal(load(path=path)["w"], -A)
