"""Nothing deletes a file a committed checkpoint (or one about to commit) still reads.

- A plain ``save`` over a manager's step directory keeps the files later incremental steps
  read (issue 42, item 2).
- ``hyper-dcp gc`` during a save leaves that save's files; a commit whose data file vanished
  fails and keeps the old checkpoint (item 4), on a local directory and on S3 (loopback).
- ``hyper-dcp gc`` refuses when a sibling step is a symbolic link (item 6).

The "during a save" moment is the writer's ``flush``: every rank calls it after its last data
file and before the coordinator writes ``.metadata`` (engine/commit.write_and_report).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from helpers import assert_same

from hyper_parallel import cli
from hyper_parallel.core.distributed_checkpoint import CheckpointError, CheckpointManager, load, save
from hyper_parallel.core.distributed_checkpoint._src.backends.filesystem import FileSystemWriter
from hyper_parallel.core.distributed_checkpoint._src.backends.fsspec import FsspecReader, FsspecWriter
from hyper_parallel.core.distributed_checkpoint._src.format import metadata as md

OLD = {"w": torch.arange(256.0).reshape(16, 16), "step": 1}
NEW = {"w": -torch.arange(256.0).reshape(16, 16), "step": 2}


def _step(run: str, n: int) -> str:
    return os.path.join(run, md.step_dir_name(n))


def _meta(path: str) -> md.Metadata:
    with open(os.path.join(path, md.METADATA_FILE), "rb") as f:
        return md.Metadata.from_json(f.read())


def _incremental_run(run: str, steps: int = 3, **manager) -> torch.Tensor:
    """Steps 1..steps where "w" never changes (later steps read it from step 1) and "v" does."""
    w = torch.arange(4096.0)
    with CheckpointManager(run, incremental=True, **manager) as mgr:
        for s in range(1, steps + 1):
            mgr.save(s, {"w": w.clone(), "v": torch.full((8,), float(s))})
    assert _meta(_step(run, steps)).referenced_dirs() == ["step_00000001"]
    return w


# ----------------------------------------------------------------------------- item 2


def test_a_plain_save_over_a_step_keeps_the_files_later_incremental_steps_read(tmp_path):
    run = str(tmp_path / "run")
    w = _incremental_run(run)
    step1 = _step(run, 1)
    read_by_later = {f.name for f in _meta(_step(run, 3)).files if f.dir == "step_00000001"}
    with pytest.warns(UserWarning, match=r"kept because other steps still read them.*step_00000002, step_00000003"):
        save({"w": torch.zeros(4096), "v": torch.zeros(8)}, checkpoint_id=step1)
    assert read_by_later <= set(os.listdir(step1))
    for s in (2, 3):
        got = load(path=_step(run, s))
        assert torch.equal(got["w"], w) and torch.equal(got["v"], torch.full((8,), float(s)))
    assert torch.equal(load(path=step1)["w"], torch.zeros(4096))  # the overwrite itself took effect


def test_a_plain_save_over_a_step_keeps_every_replaced_file_when_a_sibling_cannot_be_read(tmp_path):
    run = str(tmp_path / "run")
    _incremental_run(run, steps=2)
    step1 = _step(run, 1)
    before = set(os.listdir(step1)) - {md.METADATA_FILE}
    with open(os.path.join(_step(run, 2), md.METADATA_FILE), "r+b") as f:
        f.write(b"garbage")  # step 2 may name anything of step 1: keep it all
    with pytest.warns(UserWarning, match="all kept.*step_00000002"):
        save({"w": torch.zeros(4096)}, checkpoint_id=step1)
    assert before <= set(os.listdir(step1))


# ----------------------------------------------------------------------------- item 4


class GcDuringSave(FileSystemWriter):
    """Runs ``hyper-dcp gc PATH`` after the data is written, before ``.metadata`` is."""

    def flush(self) -> None:
        super().flush()
        assert cli.main(["gc", self.path]) == 0


class LosesAFileDuringSave(FileSystemWriter):
    """One of this save's data files is removed behind its back before the commit."""

    def write_file(self, name, parts):
        self.written = [*getattr(self, "written", []), name]
        return super().write_file(name, parts)

    def flush(self) -> None:
        super().flush()
        os.remove(os.path.join(self.path, self.written[0]))


def test_gc_during_a_save_leaves_the_files_that_save_will_commit(tmp_path, capsys):
    path = str(tmp_path / "c")
    save(OLD, path)
    save(NEW, storage_writer=GcDuringSave(path))
    assert_same(load(path=path), NEW)
    out = capsys.readouterr().out
    assert "removed 0 " in out and "left 1 " in out and "a save in progress may commit it" in out


def test_a_commit_whose_data_file_vanished_fails_and_keeps_the_old_checkpoint(tmp_path):
    path = str(tmp_path / "c")
    save(OLD, path)
    before = sorted(os.listdir(path))
    with open(os.path.join(path, md.METADATA_FILE), "rb") as f:
        committed = f.read()
    with pytest.raises(CheckpointError, match=r"refusing to commit .*no longer there \(data-r00000-"):
        save(NEW, storage_writer=LosesAFileDuringSave(path))
    assert sorted(os.listdir(path)) == before  # nothing of the old removed, the new one's rest removed
    with open(os.path.join(path, md.METADATA_FILE), "rb") as f:
        assert f.read() == committed
    assert_same(load(path=path), OLD)


class S3GcDuringSave(FsspecWriter):
    def flush(self) -> None:
        super().flush()
        assert cli.main(["gc", self.url]) == 0


class S3LosesAFileDuringSave(FsspecWriter):
    def write_file(self, name, parts):
        self.written = [*getattr(self, "written", []), name]
        return super().write_file(name, parts)

    def flush(self) -> None:
        super().flush()
        self.fs.rm_file(f"{self.root}/{self.written[0]}")


def test_gc_during_a_save_on_s3_leaves_that_save_and_a_vanished_file_fails_the_commit(
        s3_endpoint, s3_bucket, monkeypatch, capsys):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)  # what `hyper-dcp gc s3://...` reads
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/ck"
    save(OLD, storage_writer=FsspecWriter(url, **opts))
    save(NEW, storage_writer=S3GcDuringSave(url, **opts))
    out = capsys.readouterr().out
    assert "removed 0 " in out and "left 1 " in out, out
    assert_same(load(storage_reader=FsspecReader(url, **opts)), NEW)
    committed = FsspecWriter(url, **opts).read_committed()
    with pytest.raises(CheckpointError, match="no longer there"):
        save(OLD, storage_writer=S3LosesAFileDuringSave(url, **opts))
    assert FsspecWriter(url, **opts).read_committed() == committed
    assert_same(load(storage_reader=FsspecReader(url, **opts)), NEW)


# ----------------------------------------------------------------------------- item 6


def test_gc_refuses_when_a_sibling_step_is_a_symbolic_link(tmp_path, capsys):
    run = str(tmp_path / "run")
    w = _incremental_run(run, keep_latest=1)  # step 1's data stays: step 3 reads it
    step1 = _step(run, 1)
    kept = sorted(os.listdir(step1))
    assert kept and md.METADATA_FILE not in kept
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(_step(run, 3), moved / "step_00000003")
    os.symlink(moved / "step_00000003", _step(run, 3))
    assert cli.main(["gc", step1, "--min-age", "0"]) == 2  # (--min-age 0: no age spares anything)
    err = capsys.readouterr().err
    assert "step_00000003" in err and "symbolic link" in err
    assert sorted(os.listdir(step1)) == kept
    os.remove(_step(run, 3))  # the step put back where it was: it still loads
    shutil.move(moved / "step_00000003", _step(run, 3))
    assert torch.equal(load(path=_step(run, 3))["w"], w)
