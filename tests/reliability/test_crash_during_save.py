"""kill -9 a rank at each point of a save: the path then holds the old checkpoint, the new
one, or (with no old one) nothing that looks like a checkpoint. Never mixed data."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers import make_dtensor, make_tensor
from multiprocess import RankFailure, run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hyper_parallel.core.distributed_checkpoint import (
    FileSystemWriter,
    NotACheckpointError,
    load,
    save,
)

POINTS = ["before_write", "mid_write", "after_write", "in_commit"]


class CrashingWriter(FileSystemWriter):
    """Kills its own process (SIGKILL, like an OOM kill) at one point of the save protocol."""

    def __init__(self, path: str, point: str, victim: bool):
        super().__init__(path)
        self.point, self.victim = point, victim

    def _die(self, point: str) -> None:
        if self.victim and point == self.point:
            os.kill(os.getpid(), signal.SIGKILL)

    def write_file(self, name, parts):
        self._die("before_write")
        if self.point != "mid_write":
            n = super().write_file(name, parts)
            self._die("after_write")
            return n

        def half_then_die():
            for i, p in enumerate(parts):
                if i == 1:  # the header is written, the data is not
                    self._die("mid_write")
                yield p
        return super().write_file(name, half_then_die())

    def commit(self, metadata: bytes) -> None:
        # "during the commit": the temporary metadata file exists, the rename has not happened
        if self.point == "in_commit" and self.victim:
            tmp = os.path.join(self.path, ".metadata.tmp-crash")
            with open(tmp, "wb") as f:
                f.write(metadata[: len(metadata) // 2])
            self._die("in_commit")
        super().commit(metadata)


def state(ws: int, step: int) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    return {"w": make_dtensor(make_tensor((64, 256), seed=step), mesh, [Shard(0)]),
            "b": make_tensor((300, 100), seed=100 + step), "step": step}


def rank_save_then_crash(rank: int, ws: int, path: str, point: str, victim: int, with_old: bool) -> None:
    if with_old:
        save(state(ws, 1), path)
    save(state(ws, 2), storage_writer=CrashingWriter(path, point, victim == rank))


def expected(step: int) -> dict:
    return {"w": make_tensor((64, 256), seed=step), "b": make_tensor((300, 100), seed=100 + step), "step": step}


@pytest.mark.parametrize("point", POINTS)
def test_a_killed_rank_leaves_the_old_or_new_checkpoint_never_a_mix(tmp_path, point):
    for with_old, victim in ((True, 0 if point == "in_commit" else 1), (False, 0)):
        path = str(tmp_path / f"ckpt-{with_old}")
        with pytest.raises(RankFailure):
            run_ranks(rank_save_then_crash, 2, path, point, victim, with_old, grace_s=3)
        try:
            out = load(path=path)
        except NotACheckpointError:
            assert not with_old, "the older checkpoint must survive a crashed save"
            continue
        assert out["step"] in (1, 2) if with_old else out["step"] == 2
        want = expected(out["step"])
        for k in ("w", "b"):
            assert torch.equal(out[k], want[k]), f"{point}: key {k} is a mix of two saves"
