"""CheckpointManager: step naming, retention, sweep, async saves, crashes, object stores.

Policy logic is checked on the pure ``plan_retention`` and in one process; everything that
depends on ranks agreeing (discovery, retention across restarts, kills mid-save and
mid-deletion, S3) runs on real gloo ranks with real files.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
import warnings
from datetime import timedelta

import pytest
import torch
from helpers import make_dtensor, make_tensor
from multiprocess import RankFailure, run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hyper_parallel.core.distributed_checkpoint import (
    AsyncSaveError,
    CheckpointError,
    CheckpointManager,
    FileSystemWriter,
    NotACheckpointError,
    list_steps,
    load,
    verify_checkpoint,
)
from hyper_parallel.core.distributed_checkpoint._src.base.options import RetentionOptions
from hyper_parallel.core.distributed_checkpoint._src.format.metadata import step_dir_name
from hyper_parallel.core.distributed_checkpoint._src.manager.ownership import OWNER_FILE
from hyper_parallel.core.distributed_checkpoint._src.manager.retention import plan_retention
from hyper_parallel.core.distributed_checkpoint._src.manager.step_directory import LocalDirectory

# ----------------------------------------------------------------------------- helpers


def state(ws: int, step: int) -> dict:
    """A sharded state whose values depend only on ``step``."""
    mesh = init_device_mesh("cpu", (ws,))
    return {"w": make_dtensor(make_tensor((16, 8), seed=step), mesh, [Shard(0)]),
            "b": make_tensor((5,), seed=1000 + step), "step": step}


def plain(step: int) -> dict:
    return {"w": make_tensor((16, 8), seed=step), "b": make_tensor((5,), seed=1000 + step), "step": step}


def assert_holds_step(path: str, step: int) -> None:
    out = load(path=path, no_dist=True)
    assert out["step"] == step, f"{path}: step {out['step']}, expected {step}"
    assert torch.equal(out["w"], make_tensor((16, 8), seed=step)) and torch.equal(out["b"], plain(step)["b"])
    report = verify_checkpoint(path)
    assert report.ok, report.problems


def on_disk(directory: str, **opts) -> dict[int, str]:
    return {i.step: i.state for i in list_steps(directory, **opts)}


class HalfThenKill(FileSystemWriter):
    """Writes a data file's first part (the safetensors header), then SIGKILLs its process."""

    def __init__(self, path: str, delay: float = 0.0):
        super().__init__(path)
        self.delay = delay

    def write_file(self, name, parts):
        time.sleep(self.delay)

        def half():
            it = iter(parts)
            yield next(it)
            os.kill(os.getpid(), signal.SIGKILL)

        return super().write_file(name, half())


class Failing(FileSystemWriter):
    def write_file(self, name, parts):
        raise OSError(f"injected: cannot write {name}")


class Hooked(CheckpointManager):
    """A manager whose writer for ``bad_steps`` is ``writer_cls`` (crash and failure injection)."""

    def __init__(self, directory, *, bad_steps=(), writer_cls=Failing, writer_kwargs=None, kill_in_deletion=False,
                 **kwargs):
        self.bad = {step_dir_name(s) for s in bad_steps}
        self.writer_cls, self.writer_kwargs = writer_cls, writer_kwargs or {}
        self.kill_in_deletion = kill_in_deletion
        super().__init__(directory, **kwargs)

    def _storage_writer(self, name):
        if name in self.bad:
            return self.writer_cls(self._root.step_path(name), **self.writer_kwargs)
        return super()._storage_writer(name)

    def _root_for(self, directory, storage_options):
        return KillAfterUncommit(os.fspath(directory)) if self.kill_in_deletion else super()._root_for(
            directory, storage_options)


class KillAfterUncommit(LocalDirectory):
    """Dies in the middle of a deletion: the step's .metadata is gone, its data is not."""

    def remove_tree(self, name):
        time.sleep(1.0)  # the next save is in flight by now
        os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------- retention, pure


def test_retention_keeps_the_union_of_latest_every_n_and_best():
    steps = {s: {"loss": float(s)} for s in range(1, 13)}
    steps[3] = {"loss": 0.1}
    steps[7] = {"loss": 0.2}
    doomed = plan_retention(steps, RetentionOptions(keep_latest=2, keep_every_steps=5, keep_best=2, best_metric="loss"))
    assert sorted(set(steps) - set(doomed)) == [3, 5, 7, 10, 11, 12]
    doomed = plan_retention(steps, RetentionOptions(keep_best=1, best_metric="loss", best_mode="max"))
    assert sorted(set(steps) - set(doomed)) == [12]  # the best is also the newest


def test_retention_always_keeps_the_newest_protected_and_referenced_steps_and_ignores_unscored_ones():
    steps = {1: {"loss": 0.5}, 2: None, 3: {"loss": float("nan")}, 4: {"acc": 1}, 5: {"loss": "n/a"}, 6: None}
    assert plan_retention(steps, RetentionOptions()) == []  # no rule: keep everything
    doomed = plan_retention(steps, RetentionOptions(keep_best=1, best_metric="loss"), protect={2})
    assert sorted(set(steps) - set(doomed)) == [1, 2, 6]
    # PLUG (incremental): a kept step keeps the steps it references, transitively
    refs = {6: [4], 4: [3]}
    doomed = plan_retention(steps, RetentionOptions(keep_latest=1), references=lambda s: refs.get(s, []))
    assert sorted(set(steps) - set(doomed)) == [3, 4, 6]


def test_ties_for_best_go_to_the_newer_step():
    steps = {1: {"loss": 1.0}, 2: {"loss": 1.0}, 3: {"loss": 2.0}}
    assert plan_retention(steps, RetentionOptions(keep_best=1, best_metric="loss", keep_latest=1)) == [1]


# ----------------------------------------------------------------------------- one process


def test_fixed_step_names_interval_policy_and_committed_steps_only(tmp_path):
    d = str(tmp_path / "run")
    with CheckpointManager(d, save_interval_steps=10, best_metric="acc", best_mode="max") as mgr:
        assert mgr.latest_step() is None and mgr.load(plain(0)) is None
        assert mgr.save(5, plain(5)) is False  # off the interval: skipped, nothing written
        assert not os.path.exists(mgr.step_path(5))
        assert mgr.save(10, plain(10), metrics={"acc": 0.5, "note": "warmup", "bad": float("nan")}) is True
        assert mgr.save(15, plain(15), force=True) is True
        assert mgr.save(15, plain(15), force=True) is False  # already the newest committed step
        with pytest.raises(ValueError, match="older than the newest committed step 15"):
            mgr.save(10, plain(10))
        with pytest.raises(ValueError, match="metrics"):
            mgr.save(20, plain(20), metrics={"acc": object()})
        assert mgr.save(20, plain(20), metrics={"acc": torch.tensor(0.9, dtype=torch.float64)}) is True
        assert mgr.all_steps() == [10, 15, 20] and mgr.latest_step() == 20 and mgr.best_step() == 20
        m = mgr.metrics(10)
        assert m["acc"] == 0.5 and m["note"] == "warmup" and m["bad"] != m["bad"]  # nan survives
        assert mgr.metrics(15) is None and mgr.metrics(99) is None
        target = plain(0)
        assert mgr.load(target, step=15) == 15 and target["step"] == 15
        with pytest.raises(NotACheckpointError, match="step 12 is not a committed checkpoint"):
            mgr.load(plain(0), step=12)
    assert sorted(os.listdir(d)) == ["step_00000010", "step_00000015", "step_00000020"]  # owner file released
    assert step_dir_name(123456789) == "step_123456789"
    with CheckpointManager(d, save_interval_steps=10) as again:  # a restart sees the same steps
        assert again.all_steps() == [10, 15, 20] and again.metrics(20) == {"acc": 0.9}


def _crash_debris(d: str) -> list[str]:
    """Step 3 as a crashed save (data files, no .metadata), debris of an interrupted re-save in
    step 2, and directories that are not steps; returns the debris' names."""
    os.unlink(os.path.join(d, step_dir_name(3), ".metadata"))
    debris = ["data-r00000-0-0123456789abcdef.safetensors", ".metadata.tmp-abc"]
    for name in debris:
        open(os.path.join(d, step_dir_name(2), name), "wb").close()
    os.makedirs(os.path.join(d, "notes"))  # not a step name: ignored
    os.makedirs(os.path.join(d, "step_7"))  # not the canonical name of step 7: ignored
    return debris


def test_start_sweeps_uncommitted_steps_and_debris_but_leaves_other_files(tmp_path):
    d = str(tmp_path / "run")
    with CheckpointManager(d) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, plain(s))
    debris = _crash_debris(d)
    assert on_disk(d) == {1: "committed", 2: "committed", 3: "uncommitted"}
    with CheckpointManager(d) as mgr:
        assert mgr.all_steps() == [1, 2]
        mgr.wait()
        assert on_disk(d) == {1: "committed", 2: "committed"}
        left = os.listdir(os.path.join(d, step_dir_name(2)))
        assert not set(debris) & set(left) and ".metadata" in left
        assert os.path.isdir(os.path.join(d, "notes")) and os.path.isdir(os.path.join(d, "step_7"))
        assert mgr.load(plain(0)) == 2
    assert_holds_step(os.path.join(d, step_dir_name(2)), 2)


def test_while_a_step_is_unreadable_the_start_sweeps_nothing_it_might_reference(tmp_path):
    d = str(tmp_path / "run")
    with CheckpointManager(d) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, plain(s))
    _crash_debris(d)
    # step 4: a .metadata that does not parse (corrupt, or from a newer version): it might name any
    # file of the directories here (a newer release's incremental step), so none of them goes
    os.makedirs(os.path.join(d, step_dir_name(4)))
    with open(os.path.join(d, step_dir_name(4), ".metadata"), "w") as f:
        f.write("{not json")
    before = snapshot(d)
    with pytest.warns(UserWarning, match=r"step 4 \(.*\): unreadable, so ignored and left in place; while it is "
                                         r"here the manager deletes nothing it might reference"):
        mgr = CheckpointManager(d)
    with mgr:
        assert mgr.all_steps() == [1, 2]
        mgr.wait()
        assert mgr.load(plain(0)) == 2
    assert snapshot(d) == before


def test_bad_arguments_are_refused_at_once(tmp_path):
    d = str(tmp_path / "run")
    for kwargs in ({"save_interval_steps": 0}, {"keep_latest": 0}, {"keep_best": 2}, {"best_mode": "mean"},
                   {"keep_every_steps": True}):
        with pytest.raises(ValueError):
            CheckpointManager(d, **kwargs)
    with pytest.raises(ValueError, match="storage_options"):
        CheckpointManager(d, storage_options={"anon": True})
    with CheckpointManager(d) as mgr:
        with pytest.raises(ValueError, match="step must be an int"):
            mgr.save(-1, plain(0))
    with pytest.raises(RuntimeError, match="closed"):
        mgr.save(1, plain(1))


def test_one_writer_a_second_open_manager_is_refused_and_a_takeover_is_detected(tmp_path):
    d = str(tmp_path / "run")
    first = CheckpointManager(d)
    with pytest.raises(CheckpointError, match="in use by another CheckpointManager"):
        CheckpointManager(d)
    first.close()
    # a manager dropped without close() (a notebook cell run again) does not hold the directory
    dropped = CheckpointManager(d)
    dropped.save(1, plain(1))
    del dropped
    gc.collect()
    with CheckpointManager(d) as again:
        assert again.load(plain(0)) == 1
    # the owner file of a job that is gone (a dead pid) does not block a restart
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with open(os.path.join(d, OWNER_FILE), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": int(dead.stdout), "token": "old"}, f)
    mgr = CheckpointManager(d)
    mgr.save(1, plain(1))
    with open(os.path.join(d, OWNER_FILE), "w") as f:  # another job took the directory over
        json.dump({"host": "elsewhere", "pid": 1, "token": "theirs"}, f)
    with pytest.raises(CheckpointError, match="another writer took over"):
        mgr.save(2, plain(2))
    mgr.close()
    assert os.path.exists(os.path.join(d, OWNER_FILE))  # theirs: left alone


def test_a_start_that_fails_to_list_fails_clearly_and_releases_the_directory(tmp_path, monkeypatch):
    d = str(tmp_path / "run")

    def broken(self):
        raise PermissionError("injected: listing refused")

    monkeypatch.setattr(LocalDirectory, "listing", broken)
    with pytest.raises(PermissionError, match="listing refused"):
        CheckpointManager(d)
    monkeypatch.undo()
    assert not os.path.exists(os.path.join(d, OWNER_FILE))
    CheckpointManager(d).close()  # not "in use"


def test_async_failures_surface_once_on_the_next_save_and_on_wait_and_the_step_is_cleaned_up(tmp_path):
    d = str(tmp_path / "run")
    mgr = Hooked(d, bad_steps=(2, 4), async_save=True, keep_latest=1)
    assert mgr.save(1, plain(1)) and mgr.save(2, plain(2))  # step 2 fails in the background
    with pytest.raises(AsyncSaveError, match="async save of step 2") as info:
        mgr.save(3, plain(3))
    assert "injected" in str(info.value)
    assert mgr.all_steps() == [1]
    assert mgr.save(3, plain(3))  # reported once: the next save goes ahead
    assert mgr.save(4, plain(4))
    with pytest.raises(AsyncSaveError, match="async save of step 4"):
        mgr.wait()
    mgr.wait()  # nothing left to report
    assert mgr.all_steps() == [3] and on_disk(d) == {3: "committed"}  # step 1 retired, 2 and 4 cleaned
    assert [t.step for t in mgr.save_timings] == [1, 2, 3, 4]
    assert mgr.save_timings[1].total_s is None and mgr.save_timings[2].total_s > 0
    mgr.close()


def test_a_failed_synchronous_save_raises_and_leaves_no_step_behind(tmp_path):
    d = str(tmp_path / "run")
    with Hooked(d, bad_steps=(2,)) as mgr:
        mgr.save(1, plain(1))
        with pytest.raises(OSError, match="injected"):
            mgr.save(2, plain(2))
        assert mgr.all_steps() == [1]
        mgr.wait()
        assert on_disk(d) == {1: "committed"}  # the coordinator removed the failed step's debris
        assert mgr.save(3, plain(3)) and mgr.all_steps() == [1, 3]


# ----------------------------------------------------------------------------- hostile metadata


def _reseal(path: str, edit) -> bytes:
    """Rewrite the ``.metadata`` at ``path`` through ``edit(body) -> body`` (its JSON without
    the crc member), with a valid crc again: only the content is hostile, not the checksum."""
    import crc32c

    with open(path, "rb") as f:
        raw = f.read()
    member = b',"crc32c":'
    body = edit(raw[:raw.rfind(member)] + b"}")
    sealed = body[:-1] + member + b"%d}" % crc32c.crc32c(body)
    with open(path, "wb") as f:
        f.write(sealed)
    return sealed


def test_deeply_nested_metadata_is_a_metadata_error_and_the_manager_still_starts(tmp_path):
    from hyper_parallel.core.distributed_checkpoint import MetadataError
    from hyper_parallel.core.distributed_checkpoint._src.format.metadata import Metadata

    d = str(tmp_path / "run")
    with CheckpointManager(d) as mgr:
        for s in (1, 2):
            mgr.save(s, plain(s))
    deep = b"[" * 100_000 + b"]" * 100_000
    raw = _reseal(os.path.join(d, step_dir_name(2), ".metadata"), lambda body: body[:-1] + b',"x":' + deep + b"}")
    with pytest.raises(MetadataError, match="nested"):
        Metadata.from_json(raw)
    with pytest.raises(MetadataError, match="nested"):
        load(path=os.path.join(d, step_dir_name(2)), no_dist=True)
    with pytest.warns(UserWarning, match="step 2 .*unreadable, so ignored"):
        mgr = CheckpointManager(d)
    with mgr:
        assert mgr.all_steps() == [1] and mgr.load(plain(0)) == 1
    assert on_disk(d) == {1: "committed", 2: "unreadable"}


# ----------------------------------------------------------------------------- never delete what it did not write


def snapshot(path: str) -> dict[str, bytes]:
    out = {}
    for where, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(where, name), "rb") as f:
                out[os.path.relpath(os.path.join(where, name), path)] = f.read()
    return out


def test_a_step_path_that_is_a_symlink_is_refused_and_its_target_never_touched(tmp_path):
    d, victim = str(tmp_path / "run"), str(tmp_path / "victim")
    from hyper_parallel.core.distributed_checkpoint import save

    save(plain(9), victim, no_dist=True)  # a checkpoint someone keeps elsewhere
    with open(os.path.join(victim, "notes.txt"), "w") as f:
        f.write("precious")
    before = snapshot(victim)
    os.makedirs(d)
    os.symlink(victim, os.path.join(d, step_dir_name(5)))
    with CheckpointManager(d) as mgr:
        # a value that fails planning: the failed save's cleanup used to empty victim/
        with pytest.raises(CheckpointError, match=r"step_00000005.* is a symbolic link"):
            mgr.save(5, {"bad": object()})
        # a good state too: it would write (and commit) through the link
        with pytest.raises(CheckpointError, match="symbolic link"):
            mgr.save(5, plain(5))
        mgr.wait()
        assert mgr.all_steps() == [] and mgr.save(6, plain(6))
    assert os.path.islink(os.path.join(d, step_dir_name(5))) and snapshot(victim) == before


def test_the_deleter_never_walks_a_symlinked_step_directory(tmp_path):
    # were a step directory swapped for a link after the manager listed it, deleting that
    # step removes nothing behind the link
    d, victim = tmp_path / "run", tmp_path / "victim"
    victim.mkdir()
    for name in (".metadata", "data-r00000-0-0123456789abcdef.safetensors", "notes.txt"):
        (victim / name).write_bytes(b"keep")
    d.mkdir()
    os.symlink(victim, d / step_dir_name(3))
    root = LocalDirectory(str(d))
    for remove in (lambda: root.uncommit(step_dir_name(3)), lambda: root.remove_tree(step_dir_name(3)),
                   lambda: root.remove_files(step_dir_name(3), [".metadata", "notes.txt"])):
        with pytest.raises(CheckpointError, match="symbolic link"):
            remove()
    assert sorted(os.listdir(victim)) == [".metadata", "data-r00000-0-0123456789abcdef.safetensors", "notes.txt"]


def test_a_failed_save_removes_only_its_own_files(tmp_path):
    d = str(tmp_path / "run")
    step = os.path.join(d, step_dir_name(2))
    with Hooked(d, bad_steps=(2,)) as mgr:
        mgr.save(1, plain(1))
        os.makedirs(step)
        with open(os.path.join(step, "notes.txt"), "w") as f:  # not the save's: it stays
            f.write("mine")
        with pytest.raises(OSError, match="injected"):
            mgr.save(2, plain(2))
        mgr.wait()
    assert os.listdir(step) == ["notes.txt"]


def _newer_version(body: bytes) -> bytes:
    doc = json.loads(body)
    doc["version"] = 99
    return json.dumps(doc, separators=(",", ":")).encode()


def test_a_step_whose_metadata_cannot_be_read_is_neither_counted_nor_deleted_nor_overwritten(tmp_path):
    d = str(tmp_path / "run")
    with CheckpointManager(d) as mgr:
        for s in (1, 2):
            mgr.save(s, plain(s))
    meta = os.path.join(d, step_dir_name(2), ".metadata")
    _reseal(meta, _newer_version)  # written by a newer hyper-parallel
    before = snapshot(os.path.join(d, step_dir_name(2)))
    with pytest.warns(UserWarning, match="step 2 .*unreadable, so ignored"):
        mgr = CheckpointManager(d, keep_latest=1)
    with mgr:
        assert mgr.all_steps() == [1]
        for sd in ({"bad": object()}, plain(2)):  # a failing save used to delete it, a good one to replace it
            with pytest.raises(CheckpointError, match=r"step_00000002/\.metadata.*version 99 is newer"):
                mgr.save(2, sd)
        for s in (3, 4):  # retention never deletes it, nor step 1 (which it might reference)
            mgr.save(s, plain(s))
        mgr.wait()
        assert mgr.all_steps() == [1, 4]  # step 3 (saved by this run) is retired as usual
    assert snapshot(os.path.join(d, step_dir_name(2))) == before
    assert on_disk(d) == {1: "committed", 2: "unreadable", 4: "committed"}


def test_an_fsspec_directory_memory_filesystem(tmp_path):
    url = f"memory://hp-manager/{uuid.uuid4().hex}"
    with CheckpointManager(url, keep_latest=2) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, plain(s), metrics={"loss": 1.0 / s})
        assert mgr.all_steps() == [2, 3]
    assert on_disk(url) == {2: "committed", 3: "committed"}
    with CheckpointManager(url, keep_latest=2) as mgr:
        target = plain(0)
        assert mgr.load(target) == 3 and torch.equal(target["w"], plain(3)["w"])
        assert mgr.metrics(2) == {"loss": 0.5}


def test_timeout_must_be_positive_seconds_or_timedelta_or_none(tmp_path):
    d = str(tmp_path / "run")
    for bad in (-1, 0, float("nan"), float("inf"), 1e300, timedelta(0), timedelta(seconds=-5)):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            CheckpointManager(d, timeout=bad)
    for bad in ("30", True, [30]):
        with pytest.raises(TypeError, match="timeout must be a number of seconds > 0.*got"):
            CheckpointManager(d, timeout=bad)
    assert not os.path.exists(os.path.join(d, OWNER_FILE))  # refused before the manager started
    for good, seconds in ((None, None), (5, 5.0), (2.5, 2.5), (timedelta(seconds=3), 3.0)):
        with CheckpointManager(d, timeout=good) as mgr:
            assert (mgr.timeout.total_seconds() if mgr.timeout is not None else None) == seconds


def test_load_checks_the_type_of_step_as_save_does(tmp_path):
    with CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(1, plain(1))
        mgr.save(6, plain(6))
        for bad in ("6", True, -1, 6.0):
            with pytest.raises(ValueError, match=r"step must be an int >= 0, got"):
                mgr.load(plain(0), step=bad)
        target = plain(0)
        assert mgr.load(target, step=6) == 6 and target["step"] == 6


def test_load_of_a_listed_step_survives_the_retention_of_the_save_it_settles(tmp_path):
    """keep_latest=2 with an async save in flight: all_steps() lists [1, 2]; load(step=1)
    settles the save of step 3, whose retention must not delete step 1 (the next one may)."""
    d = str(tmp_path / "run")
    with CheckpointManager(d, keep_latest=2, async_save=True) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, plain(s))
        assert mgr.all_steps() == [1, 2]  # step 3 in flight
        target = plain(0)
        assert mgr.load(target, step=1) == 1
        assert target["step"] == 1 and torch.equal(target["w"], plain(1)["w"])
        assert mgr.all_steps() == [1, 2, 3]  # protected from that retention pass only
        mgr.save(4, plain(4))
        mgr.wait()
        assert mgr.all_steps() == [3, 4]
    assert on_disk(d) == {3: "committed", 4: "committed"}


def test_async_save_takes_a_checkpointer_of_ones_own(tmp_path):
    """CheckpointManager(async_save=AsyncCheckpointer(...)) saves through that checkpointer,
    with its settings (here: a snapshot staged as column bands), and closes it."""
    from hyper_parallel.core.distributed_checkpoint import AsyncCheckpointer
    from hyper_parallel.core.distributed_checkpoint._src.planning.staged_bands import BandedSnapshot

    d = str(tmp_path / "run")
    ckpt = AsyncCheckpointer(stage_bands=True)
    big = {"w": make_tensor((1024, 1024)), "step": 0}
    seen = []
    region = BandedSnapshot.region
    BandedSnapshot.region = lambda self, index: seen.append(index) or region(self, index)
    try:
        with CheckpointManager(d, async_save=ckpt, keep_latest=1) as mgr:
            for s in (1, 2):
                big["step"] = s
                expected = big["w"].clone()
                mgr.save(s, big)
                big["w"].add_(1)  # right after the snapshot
            mgr.wait()
            assert mgr.all_steps() == [2] and ckpt.stats.allocations == 1
            target = {"w": torch.zeros(1024, 1024), "step": 0}
            assert mgr.load(target) == 2
            assert torch.equal(target["w"], expected) and target["step"] == 2
    finally:
        BandedSnapshot.region = region
    assert seen  # the bands were written from the snapshot
    assert ckpt.in_flight == 0
    with pytest.raises(ValueError, match="max_in_flight=1"):
        CheckpointManager(d, async_save=AsyncCheckpointer(max_in_flight=2))
    with pytest.raises(TypeError, match="async_save"):
        CheckpointManager(d, async_save="yes")


# ----------------------------------------------------------------------------- real ranks


def rank_bad_timeout(rank: int, ws: int, d: str, timeout) -> str:
    try:
        CheckpointManager(d, timeout=timeout).close()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def test_a_bad_timeout_is_refused_on_every_rank_before_any_collective(tmp_path):
    # before: -1 reached gloo ("A rank crashed" LostContactError) and "30" torch's TypeError
    for bad, error in ((-1, "ValueError"), ("30", "TypeError")):
        out = run_ranks(rank_bad_timeout, 2, str(tmp_path / "run"), bad, timeout_s=60)
        assert all(o.startswith(f"{error}: timeout must be") for o in out), out


def rank_policies(rank: int, ws: int, d: str, steps: list[int], losses: dict[int, float], kwargs: dict) -> dict:
    seen = {}
    with CheckpointManager(d, timeout=30, **kwargs) as mgr:
        target = state(ws, 0)
        resumed = mgr.load(target)
        for s in steps:
            mgr.save(s, state(ws, s), metrics={"loss": losses[s]} if s in losses else None)
            seen[s] = mgr.all_steps()
        mgr.wait()
        return {"resumed": resumed, "loaded_step": target["step"], "seen": seen, "final": mgr.all_steps(),
                "best": mgr.best_step(), "w": target["w"].to_local().tolist()}


def test_policies_latest_every_n_and_best_n_across_a_restart_on_2_ranks(tmp_path):
    d = str(tmp_path / "run")
    policy = dict(keep_latest=2, keep_every_steps=5, keep_best=1, best_metric="loss")
    losses = {s: 1.0 + s for s in range(1, 13)}
    losses[3] = 0.1  # the best step, saved before the restart
    first = run_ranks(rank_policies, 2, d, list(range(1, 9)), losses, policy)
    assert first[0]["seen"] == first[1]["seen"]  # every rank sees the same steps
    assert first[0]["seen"][4] == [3, 4] and first[0]["final"] == [3, 5, 7, 8]
    assert on_disk(d) == dict.fromkeys([3, 5, 7, 8], "committed")
    second = run_ranks(rank_policies, 2, d, list(range(9, 13)), losses, policy)
    assert [r["resumed"] for r in second] == [8, 8] and second[0]["loaded_step"] == 8
    mesh_rows = 16 // 2
    for rank, r in enumerate(second):
        assert r["w"] == make_tensor((16, 8), seed=8)[rank * mesh_rows:(rank + 1) * mesh_rows].tolist()
    assert second[0]["final"] == second[1]["final"] == [3, 5, 10, 11, 12]  # best-N kept step 3 after the restart
    assert second[0]["best"] == 3
    assert on_disk(d) == dict.fromkeys([3, 5, 10, 11, 12], "committed")
    for s in (3, 12):
        assert_holds_step(os.path.join(d, step_dir_name(s)), s)


def rank_async_4(rank: int, ws: int, d: str) -> dict:
    accuracy = {2: 0.3, 4: 0.9, 6: 0.5, 8: 0.4}
    with CheckpointManager(d, save_interval_steps=2, keep_latest=1, keep_best=1, best_metric="acc",
                           best_mode="max", async_save=True, timeout=30) as mgr:
        saved = [s for s in range(1, 9) if mgr.save(s, state(ws, s), metrics={"acc": accuracy.get(s, 0.0)})]
        mgr.wait()
        target = state(ws, 0)
        loaded = mgr.load(target, step=mgr.best_step())
        out = {"saved": saved, "steps": mgr.all_steps(), "loaded": loaded, "step": target["step"],
               "w": target["w"].to_local().tolist(), "timings": len(mgr.save_timings)}
    # a restart (a fresh manager, synchronous now): the best step is still known and kept
    with CheckpointManager(d, keep_latest=1, keep_best=1, best_metric="acc", best_mode="max", timeout=30) as mgr:
        out["restart"] = (mgr.all_steps(), mgr.best_step())
        mgr.save(10, state(ws, 10), metrics={"acc": 0.1})
        out["after"] = mgr.all_steps()
    return out


def test_async_saves_and_best_n_across_a_restart_on_4_ranks(tmp_path):
    d = str(tmp_path / "run")
    results = run_ranks(rank_async_4, 4, d)
    full = make_tensor((16, 8), seed=4)
    for rank, r in enumerate(results):
        assert r["saved"] == [2, 4, 6, 8] and r["steps"] == [4, 8] and r["loaded"] == 4 and r["step"] == 4
        assert r["w"] == full[rank * 4:(rank + 1) * 4].tolist() and r["timings"] == 4
        assert r["restart"] == ([4, 8], 4) and r["after"] == [4, 10]
    assert on_disk(d) == {4: "committed", 10: "committed"}


def rank_listing_fails_on_the_coordinator(rank: int, ws: int, d: str) -> str:
    def broken(self):
        raise PermissionError("injected: listing refused")

    LocalDirectory.listing = broken  # only the coordinator lists
    started = time.monotonic()
    try:
        CheckpointManager(d, timeout=20)
    except CheckpointError as exc:
        return f"{type(exc).__name__} after {time.monotonic() - started:.1f}s: {exc}"
    return "no error"


def test_a_listing_error_on_the_coordinator_fails_every_rank_at_once(tmp_path):
    outcomes = run_ranks(rank_listing_fails_on_the_coordinator, 2, str(tmp_path / "run"))
    for o in outcomes:
        assert o.startswith("RankFailedError") and "[rank 0] PermissionError: injected" in o, o
        assert float(o.split(" after ")[1].split("s:")[0]) < 10, o  # not the 20 s timeout


def rank_save_then_killed(rank: int, ws: int, d: str) -> None:
    with Hooked(d, bad_steps=(4,), writer_cls=HalfThenKill, timeout=30) as mgr:
        for s in (1, 2, 3, 4):  # both ranks die in the middle of writing step 4
            mgr.save(s, state(ws, s))


def rank_resume(rank: int, ws: int, d: str) -> dict:
    with CheckpointManager(d, timeout=30) as mgr:
        target = state(ws, 0)
        step = mgr.load(target)
        steps = mgr.all_steps()
        mgr.save(step + 1, state(ws, step + 1))
        return {"step": step, "value": target["step"], "steps_at_start": steps, "steps": mgr.all_steps(),
                "w": target["w"].to_local().tolist()}


def test_resume_from_the_latest_committed_step_after_sigkill_mid_save(tmp_path):
    d = str(tmp_path / "run")
    with pytest.raises(RankFailure):
        run_ranks(rank_save_then_killed, 2, d, grace_s=3)
    assert on_disk(d) == {1: "committed", 2: "committed", 3: "committed", 4: "uncommitted"}
    results = run_ranks(rank_resume, 2, d)
    for rank, r in enumerate(results):
        assert r["step"] == 3 and r["value"] == 3 and r["steps_at_start"] == [1, 2, 3]
        assert r["w"] == make_tensor((16, 8), seed=3)[rank * 8:(rank + 1) * 8].tolist()
        assert r["steps"] == [1, 2, 3, 4]  # the new step 4 replaced the swept debris
    assert on_disk(d) == dict.fromkeys([1, 2, 3, 4], "committed")
    assert_holds_step(os.path.join(d, step_dir_name(4)), 4)


def rank_async_killed_in_flight(rank: int, ws: int, d: str) -> None:
    # keep_latest=1: committing step 2 retires step 1 while step 3 is in flight. The
    # coordinator dies inside that deletion (after step 1's .metadata went); step 3 never lands.
    mgr = Hooked(d, bad_steps=(3,), writer_cls=HalfThenKill, writer_kwargs={"delay": 3.0},
                 kill_in_deletion=rank == 0, keep_latest=1, async_save=True, timeout=30)
    mgr.save(1, state(ws, 1))
    mgr.save(2, state(ws, 2))
    mgr.save(3, state(ws, 3))  # settles step 2 (retention runs), then step 3 goes in flight
    time.sleep(30)  # killed before this ends


def test_async_retention_never_deletes_the_newest_committed_step_kill_during_save_and_deletion(tmp_path):
    d = str(tmp_path / "run")
    with pytest.raises(RankFailure):
        run_ranks(rank_async_killed_in_flight, 2, d, grace_s=2)
    # step 1: cut short after its .metadata went (its data is still there): clearly partial;
    # step 3: the save in flight when the coordinator died; it never committed
    assert on_disk(d) == {1: "uncommitted", 2: "committed", 3: "uncommitted"}
    assert any(f.startswith("data-") for f in os.listdir(os.path.join(d, step_dir_name(1))))
    assert_holds_step(os.path.join(d, step_dir_name(2)), 2)  # the newest committed step is whole
    results = run_ranks(rank_resume, 2, d)
    assert [r["step"] for r in results] == [2, 2] and results[0]["steps_at_start"] == [2]
    assert on_disk(d) == {2: "committed", 3: "committed"}  # 1 swept; 3 swept, then saved anew


# ----------------------------------------------------------------------------- object store


def rank_s3(rank: int, ws: int, url: str, opts: dict) -> dict:
    """Two jobs in a row on the same ranks: a fresh manager rediscovers the steps as after a restart."""
    import torch.distributed as dist

    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    out = {}
    with CheckpointManager(url, keep_latest=2, async_save=True, storage_options=opts, timeout=30) as mgr:
        out["first_resumed"] = mgr.load(state(ws, 0))
        for s in (1, 2, 3, 4):
            mgr.save(s, state(ws, s), metrics={"loss": 1.0 / s})
        mgr.wait()
        out["first_steps"] = mgr.all_steps()
    if rank == 0:  # debris of a crashed save of step 5: one partial object, no .metadata
        import s3fs

        s3fs.S3FileSystem(**opts).pipe_file(
            f"{url.removeprefix('s3://')}/{step_dir_name(5)}/data-r00001-0-0123456789abcdef.safetensors", b"part")
        out["before"] = {i.step: i.state for i in list_steps(url, storage_options=opts)}
    dist.barrier()
    with CheckpointManager(url, keep_latest=2, async_save=True, storage_options=opts, timeout=30) as mgr:
        target = state(ws, 0)
        out["resumed"] = mgr.load(target)
        mgr.save(5, state(ws, 5), metrics={"loss": 0.2})
        mgr.wait()
        out.update(value=target["step"], steps=mgr.all_steps(), w=target["w"].to_local().tolist())
    return out


def test_the_manager_on_an_s3_server(s3_bucket):
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/run"
    results = run_ranks(rank_s3, 2, url, opts)
    assert results[0]["before"] == {3: "committed", 4: "committed", 5: "uncommitted"}
    for rank, r in enumerate(results):
        assert r["first_resumed"] is None and r["first_steps"] == [3, 4]
        assert r["resumed"] == 4 and r["value"] == 4 and r["steps"] == [4, 5]
        assert r["w"] == make_tensor((16, 8), seed=4)[rank * 8:(rank + 1) * 8].tolist()
    infos = {i.step: i for i in list_steps(url, storage_options=opts)}
    assert sorted(infos) == [4, 5] and infos[5].metrics == {"loss": 0.2} and infos[5].bytes > 0
    assert infos[5].files == 3  # two data files and .metadata: the partial object was swept
    import s3fs

    assert not s3fs.S3FileSystem(**opts).exists(f"{bucket}/run/{OWNER_FILE}")  # released at close


def late_once(rank: int, ws: int, root: str, use_async: bool) -> list:
    import torch.distributed as dist

    mgr = CheckpointManager(root, async_save=use_async, timeout=2)
    out = []
    for step in range(1, 5):
        dist.barrier()
        if step == 2 and rank == 1:
            time.sleep(5)  # one slow step on one rank: longer than the timeout
        try:
            mgr.save(step, plain(step))
            mgr.wait()
            out.append("ok")
        except Exception as exc:  # noqa: BLE001 - the job catches it and trains on
            out.append(type(exc).__name__)
    out.append(mgr.all_steps())
    mgr.close()
    return out


@pytest.mark.parametrize("use_async", [False, True])
def test_a_manager_keeps_checkpointing_after_one_save_timed_out(tmp_path, use_async):
    # gloo cannot use a group again after a timeout: the manager must make a new one, not
    # fail every later save of the run
    for result in run_ranks(late_once, 2, str(tmp_path / "ckpt"), use_async, timeout_s=120):
        assert result[0] == "ok" and result[1] != "ok", result
        assert result[2:4] == ["ok", "ok"], result
        assert {1, 3, 4} <= set(result[4]) and 2 not in result[4], result


def test_the_sweep_keeps_the_files_an_unreadable_incremental_step_references(tmp_path):
    d = str(tmp_path / "run")
    frozen = make_tensor((256, 256), seed=7)
    with CheckpointManager(d, incremental=True, keep_latest=1) as mgr:
        for s in (1, 2, 3):  # "frozen" is written once, at step 1; steps 2 and 3 name step 1's file
            mgr.save(s, {"frozen": frozen, "w": make_tensor((16, 8), seed=s)})
        mgr.wait()
    assert on_disk(d) == {1: "uncommitted", 3: "committed"}  # step 1 kept for the file step 3 names
    meta = os.path.join(d, step_dir_name(3), ".metadata")
    with open(meta, "rb") as f:
        original = f.read()
    _reseal(meta, _newer_version)  # as a newer release would have written it
    with pytest.warns(UserWarning, match="step 3"):
        mgr = CheckpointManager(d, incremental=True, keep_latest=1)
    with mgr:
        assert mgr.all_steps() == []
        mgr.save(4, {"frozen": frozen, "w": make_tensor((16, 8), seed=4)})
        mgr.save(5, {"frozen": frozen, "w": make_tensor((16, 8), seed=5)})
        mgr.wait()
        assert mgr.all_steps() == [5]
    with open(meta, "wb") as f:  # "upgrading again": step 3 is readable, and still whole
        f.write(original)
    out = load(path=os.path.join(d, step_dir_name(3)), no_dist=True)
    assert torch.equal(out["frozen"], frozen) and torch.equal(out["w"], make_tensor((16, 8), seed=3))
    assert verify_checkpoint(os.path.join(d, step_dir_name(3))).ok


def test_the_sweep_keeps_the_files_a_symlinked_incremental_step_references(tmp_path):
    d = str(tmp_path / "run")
    moved = os.path.join(d, "step3-moved")  # not a step name: beside the steps, so "../step_00000001" resolves
    frozen = make_tensor((256, 256), seed=7)
    with CheckpointManager(d, incremental=True, keep_latest=1) as mgr:
        for s in (1, 2, 3):  # steps 2 and 3 read "frozen" from step 1's file
            mgr.save(s, {"frozen": frozen, "w": make_tensor((16, 8), seed=s)})
        mgr.wait()
    os.rename(os.path.join(d, step_dir_name(3)), moved)  # step 3 moved aside and linked back
    os.symlink(moved, os.path.join(d, step_dir_name(3)))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with CheckpointManager(d, incremental=True, keep_latest=1) as mgr:
            mgr.save(4, {"frozen": frozen, "w": make_tensor((16, 8), seed=4)})
            mgr.wait()
    out = load(path=os.path.join(d, step_dir_name(3)), no_dist=True)  # through the link: still whole
    assert torch.equal(out["frozen"], frozen) and torch.equal(out["w"], make_tensor((16, 8), seed=3))
    assert any("a symbolic link, never walked" in str(w.message) for w in said), [str(w.message) for w in said]
