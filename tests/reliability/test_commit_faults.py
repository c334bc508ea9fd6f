"""A committed checkpoint is never lost: faults at and after the commit point, on 2 real ranks.

Each test saves v1, then tries v2 over it with a fault injected at one point of the commit
protocol (hyper_parallel.core.distributed_checkpoint._src.engine.commit), and says which checkpoint the
protocol promises for that point. Whatever happens, the path loads one of them whole.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import warnings

import pytest
import torch
from helpers import make_dtensor, make_tensor
from multiprocess import RankFailure, run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hyper_parallel.core.distributed_checkpoint import (
    CommitError,
    FileSystemWriter,
    RankFailedError,
    load,
    save,
    verify_checkpoint,
)
from hyper_parallel.core.distributed_checkpoint._src.backends.filesystem import FileSystemReader
from hyper_parallel.core.distributed_checkpoint._src.engine.commit import collect_garbage


def state(ws: int, step: int) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    return {"w": make_dtensor(make_tensor((64, 32), seed=step), mesh, [Shard(0)]),
            "b": make_tensor((30, 10), seed=100 + step), "step": step}


def expect_whole(path: str, step: int) -> None:
    out = load(path=path)
    assert out["step"] == step, f"expected checkpoint v{step}, found v{out['step']}"
    assert torch.equal(out["w"], make_tensor((64, 32), seed=step))
    assert torch.equal(out["b"], make_tensor((30, 10), seed=100 + step))
    report = verify_checkpoint(path)
    assert report.ok, report.problems


class FaultyWriter(FileSystemWriter):
    """A FileSystemWriter that misbehaves at one point of the coordinator's commit."""

    def __init__(self, path: str, fault: str, victim_pid: int | None = None):
        super().__init__(path)
        self.fault, self.victim_pid = fault, victim_pid

    def commit(self, metadata: bytes) -> None:
        if self.fault == "kill_peer_then_commit":
            os.kill(self.victim_pid, signal.SIGKILL)  # the peer dies inside the commit exchange
        if self.fault == "raise_before_rename":
            raise OSError("injected: metadata write failed")
        super().commit(metadata)
        if self.fault == "raise_after_rename":
            raise OSError("injected: directory fsync failed after the rename")
        if self.fault == "kill_self_after_rename":
            os.kill(os.getpid(), signal.SIGKILL)

    def remove(self, names):
        if self.fault == "remove_fails":
            raise PermissionError("injected: the object store refused the DELETE")
        super().remove(names)


def rank_v1_then_faulty_v2(rank: int, ws: int, path: str, fault: str) -> str:
    """Returns (and records in ``<path>.outcome<rank>``, for ranks whose peer was killed)
    what this rank's save of v2 ended in."""
    save(state(ws, 1), path)
    pids = [None] * ws
    torch.distributed.all_gather_object(pids, os.getpid())
    writer = FaultyWriter(path, fault if rank == 0 else "none", victim_pid=pids[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            save(state(ws, 2), storage_writer=writer, timeout=20)
            outcome = "ok" + "".join(f"|{w.message}" for w in caught)
        except CommitError as exc:
            outcome = f"CommitError committed={exc.committed}"
        except RankFailedError:
            outcome = "RankFailedError"
    with open(f"{path}.outcome{rank}", "w") as f:
        f.write(outcome)
    return outcome


def outcome(path: str, rank: int) -> str:
    with open(f"{path}.outcome{rank}") as f:
        return f.read()


def test_a_failure_after_the_rename_keeps_the_new_checkpoint(tmp_path):
    path = str(tmp_path / "c")
    outcomes = run_ranks(rank_v1_then_faulty_v2, 2, path, "raise_after_rename")
    assert all(o.startswith("ok") for o in outcomes), outcomes  # the commit happened: save succeeds
    assert "committed" in outcomes[0] and "injected" in outcomes[0]  # ...and the coordinator warns
    expect_whole(path, 2)  # promised: v2


def test_a_failure_before_the_rename_keeps_the_old_checkpoint_and_leaves_no_debris(tmp_path):
    path = str(tmp_path / "c")
    assert run_ranks(rank_v1_then_faulty_v2, 2, path, "raise_before_rename") == ["RankFailedError"] * 2
    expect_whole(path, 1)  # promised: v1
    assert verify_checkpoint(path).unreferenced == []  # every rank removed its v2 files


def test_an_undeletable_old_file_is_a_warning_and_the_new_checkpoint_stands(tmp_path):
    path = str(tmp_path / "c")
    outcomes = run_ranks(rank_v1_then_faulty_v2, 2, path, "remove_fails")
    assert all(o.startswith("ok") for o in outcomes), outcomes
    assert "could not be removed" in outcomes[0]
    expect_whole(path, 2)
    left = verify_checkpoint(path).unreferenced
    # v1's file of rank 0, whose writer failed, reported; rank 1 removed the one it wrote
    assert len(left) == 1 and left[0].startswith("data-r00000-"), left
    assert collect_garbage(FileSystemReader(path), FileSystemWriter(path)) == left  # ...and reclaimable
    expect_whole(path, 2)
    assert verify_checkpoint(path).unreferenced == []


@contextlib.contextmanager
def immutable(files: list[str]):
    """``chattr +i``: unlink fails with EPERM even for root (ext4), like an NFS EBUSY."""
    done = []
    try:
        for f in files:
            if subprocess.run(["chattr", "+i", f], capture_output=True).returncode != 0:
                pytest.skip("chattr +i is not supported on this filesystem")
            done.append(f)
        yield
    finally:
        for f in done:
            subprocess.run(["chattr", "-i", f], check=False)


@pytest.mark.skipif(shutil.which("chattr") is None, reason="needs chattr")
def test_a_real_undeletable_old_file_chattr(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(save_v1, 2, path)
    v1_files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.startswith("data-r00001-"))
    with immutable(v1_files[:1]):
        warned = run_ranks(save_v2, 2, path)
        # each rank removes the replaced files it wrote: rank 1 meets the undeletable one
        assert "could not be removed" in warned[1] and "could not be removed" not in warned[0], warned
        expect_whole(path, 2)  # v2 committed although v1's file could not be deleted
    assert verify_checkpoint(path).unreferenced == [os.path.basename(v1_files[0])]


def save_v1(rank: int, ws: int, path: str) -> None:
    save(state(ws, 1), path)


def save_v2(rank: int, ws: int, path: str) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save(state(ws, 2), path)
    return "".join(str(w.message) for w in caught)


def test_sigkill_of_a_non_coordinator_during_the_commit_exchange(tmp_path):
    path = str(tmp_path / "c")
    with pytest.raises(RankFailure):  # rank 1 is killed inside the exchange
        run_ranks(rank_v1_then_faulty_v2, 2, path, "kill_peer_then_commit", grace_s=25)
    # the coordinator committed, then lost contact, and says so
    assert outcome(path, 0) == "CommitError committed=True"
    expect_whole(path, 2)  # promised: v2 (nobody deleted its data)


def test_sigkill_of_the_coordinator_right_after_the_rename(tmp_path):
    path = str(tmp_path / "c")
    with pytest.raises(RankFailure):  # the coordinator is killed
        run_ranks(rank_v1_then_faulty_v2, 2, path, "kill_self_after_rename", grace_s=25)
    # rank 1 cannot know whether the commit happened: it says so and keeps its files
    assert outcome(path, 1) == "CommitError committed=None"
    expect_whole(path, 2)  # promised: v2


def save_step(rank: int, ws: int, path: str, step: int) -> None:
    save(state(ws, step), path)


def test_saving_over_a_checkpoint_of_more_ranks_removes_every_replaced_file(tmp_path):
    # 4 ranks wrote v1; 2 ranks replace it: the files of ranks 2 and 3, whose writers are
    # gone, are shared out among the ranks that remain
    path = str(tmp_path / "c")
    run_ranks(save_step, 4, path, 1)
    v1 = {f for f in os.listdir(path) if f.startswith("data-")}
    assert {f[:12] for f in v1} == {f"data-r0000{r}-" for r in range(4)}
    run_ranks(save_step, 2, path, 2)
    expect_whole(path, 2)
    left = {f for f in os.listdir(path) if f.startswith("data-")}
    assert not left & v1 and {f[:12] for f in left} == {"data-r00000-", "data-r00001-"}, left
    assert verify_checkpoint(path).unreferenced == []
