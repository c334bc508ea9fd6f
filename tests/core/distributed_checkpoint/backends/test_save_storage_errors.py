"""A storage failure of a save is the library's error in one process as on several ranks.

A save of several ranks reports an OSError of any rank inside RankFailedError, a
CheckpointError and so torch's ``CheckpointException``. A save in one process (``no_dist=True``,
or no process group) let the OSError out as it was, so ``except CheckpointException`` (torch
DCP's contract) missed it. Now it is a StorageError: a CheckpointException that is still an
OSError of the original's kind, with its errno and file, the original chained as the cause.
Failures are real: a path through a regular file, an immutable directory (``chattr +i``; root
ignores permission bits).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest
import torch
from helpers import bits
from multiprocess import run_ranks
from torch.distributed.checkpoint.api import CheckpointException

from hyper_parallel.core.distributed_checkpoint import AsyncCheckpointer, AsyncSaveError, FileSystemWriter, load, save
from hyper_parallel.core.distributed_checkpoint._src.base.errors import (
    CheckpointError,
    RankFailedError,
    StorageError,
    StorageNotADirectoryError,
    StoragePermissionError,
)


@contextlib.contextmanager
def immutable(path: str) -> Iterator[None]:
    """``path`` made immutable with ``chattr +i`` (nothing may be created in it, even by root)."""
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    done = subprocess.run(["chattr", "+i", path], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"chattr +i refused here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", path], check=True)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("no_dist", [True, False], ids=["no_dist", "no-process-group"])
def test_a_path_through_a_regular_file_is_a_checkpoint_exception_keeping_the_os_error(tmp_path, no_dist):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    where = str(blocker / "ckpt")
    with pytest.raises(CheckpointException) as info:
        save({"w": torch.ones(3)}, where, no_dist=no_dist)
    e = info.value
    assert isinstance(e, CheckpointError) and isinstance(e, StorageNotADirectoryError)
    assert isinstance(e, NotADirectoryError) and e.errno == errno.ENOTDIR  # code catching the OS error still works
    assert e.filename == where
    assert str(e).startswith(f"checkpoint save to {where!r} failed: [Errno {errno.ENOTDIR}]"), str(e)
    assert type(e.__cause__) is NotADirectoryError and e.__cause__.errno == errno.ENOTDIR


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_immutable_directory_is_a_checkpoint_exception_and_keeps_the_old_checkpoint(tmp_path):
    where = str(tmp_path / "ckpt")
    old = {"w": torch.arange(6.0), "step": 1}
    save(old, where, no_dist=True)
    before = sorted(os.listdir(where))
    with immutable(where):
        with pytest.raises(CheckpointException) as info:
            save({"w": torch.zeros(6), "step": 2}, where, no_dist=True)
        assert sorted(os.listdir(where)) == before
    e = info.value
    assert isinstance(e, StoragePermissionError) and isinstance(e, PermissionError)
    assert e.errno == errno.EPERM and e.filename.startswith(where + os.sep), e.filename
    assert "Operation not permitted" in str(e) and repr(where) in str(e)
    assert isinstance(e.__cause__, PermissionError) and not isinstance(e.__cause__, CheckpointError)
    got = load(path=where)
    assert got["step"] == 1 and torch.equal(bits(got["w"]), bits(old["w"]))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_async_save_alone_reports_the_same_error(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("")
    ckpt = AsyncCheckpointer()  # its own: the default one would report the failure again to a later test
    try:
        resp = ckpt.save({"w": torch.ones(3)}, checkpoint_id=str(blocker / "ckpt"), no_dist=True)
        with pytest.raises(CheckpointException) as info:
            resp.result()
    finally:
        with contextlib.suppress(AsyncSaveError):
            ckpt.close()
    chain = [info.value]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    assert any(isinstance(e, StorageError) and e.errno == errno.ENOTDIR for e in chain), chain


class FullDiskWriter(FileSystemWriter):
    """One rank's disk is full (a real ENOSPC needs a small filesystem; the point here is what
    each rank raises, which does not depend on how the OS error came about)."""

    def __init__(self, path: str, failing_rank: int | None):
        super().__init__(path)
        self.failing_rank = failing_rank

    def set_up(self, rank: int, is_coordinator: bool) -> None:
        super().set_up(rank, is_coordinator)
        self.rank = rank

    def write_file(self, name, parts):
        if self.failing_rank is None or self.rank == self.failing_rank:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(self.path, name))
        return super().write_file(name, parts)


def _full_disk_on_ranks(rank: int, ws: int, d: str) -> tuple[str, str, str | None]:
    # rank 0 writes the one (replicated) tensor: its disk is the full one
    try:
        save({"w": torch.ones(4)}, storage_writer=FullDiskWriter(d, failing_rank=0))
    except CheckpointException as e:
        return type(e).__name__, str(e), type(e.__cause__).__name__ if e.__cause__ is not None else None
    return "none", "", None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_one_process_and_two_ranks_both_raise_a_checkpoint_exception_naming_the_os_error(tmp_path):
    with pytest.raises(CheckpointException) as alone:
        save({"w": torch.ones(4)}, storage_writer=FullDiskWriter(str(tmp_path / "a"), failing_rank=None), no_dist=True)
    assert isinstance(alone.value, StorageError) and alone.value.errno == errno.ENOSPC
    assert "No space left on device" in str(alone.value)

    ranks = run_ranks(_full_disk_on_ranks, 2, str(tmp_path / "b"), timeout_s=120)
    for rank, (kind, text, cause) in enumerate(ranks):
        assert kind == RankFailedError.__name__, ranks
        assert "[rank 0]" in text and "No space left on device" in text, text
        assert cause == ("OSError" if rank == 0 else None), ranks  # the failing rank chains its own error
