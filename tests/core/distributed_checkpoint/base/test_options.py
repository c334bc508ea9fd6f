"""The option records (base/options.py) and the public calls that build them.

``async_save``, ``AsyncCheckpointer.save`` and ``CheckpointManager`` keep the keywords torch DCP
and HyperParallel users pass; each builds the records once and hands them down. These tests
pin both sides: the records are values (frozen, equal when their options are), every keyword
of the public calls lands in a record and reaches the save, and bad keywords are refused as
before, naming the keyword, before anything is written.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from datetime import timedelta

import pytest
import torch

from hyper_parallel.core.distributed_checkpoint import AsyncCheckpointer, CheckpointManager, async_save, load
from hyper_parallel.core.distributed_checkpoint._src.asynchronous.checkpointer import SaveRequest
from hyper_parallel.core.distributed_checkpoint._src.base.options import (
    AsyncOptions,
    BroadcastOptions,
    Coordination,
    IncrementalOptions,
    LocalTierOptions,
    ReadOptions,
    RetentionOptions,
    WriteOptions,
    as_keywords,
    pick,
)

RECORDS = [Coordination, WriteOptions, ReadOptions, BroadcastOptions, AsyncOptions, RetentionOptions,
           IncrementalOptions, LocalTierOptions]


def plain(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 8, generator=g), "b": torch.randn(5, generator=g), "step": seed}


# ----------------------------------------------------------------------------- the records


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_every_record_is_frozen_and_equal_records_are_one_value(cls):
    record = cls()
    first = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, first, "changed")
    assert cls() == record and hash(cls()) == hash(record)
    assert {record: 1}[cls()] == 1  # usable as a key (e.g. a cache of groups by coordination)


def test_pick_takes_the_fields_named_in_the_keywords_and_leaves_the_rest_at_their_defaults():
    values = {"thread_count": 3, "user_metadata": {"a": 1}, "staging": "lazy", "process_group": "pg"}
    assert pick(WriteOptions, values) == WriteOptions(thread_count=3, user_metadata={"a": 1})
    assert pick(AsyncOptions, values) == AsyncOptions(staging="lazy")
    assert pick(Coordination, values) == Coordination(process_group="pg")
    assert pick(RetentionOptions, {}) == RetentionOptions()


def test_pick_with_a_prefix_reads_the_prefixed_keywords_only():
    values = {"broadcast_batch_bytes": 1 << 20, "broadcast_replicated_tensors": True, "groups": "not mine"}
    assert pick(BroadcastOptions, values, "broadcast_") == BroadcastOptions(replicated_tensors=True,
                                                                           batch_bytes=1 << 20)


def test_as_keywords_hands_down_the_values_themselves_and_refuses_a_field_of_two_records():
    group = object()  # a process group must reach the call as the same object, not a copy
    kw = as_keywords(Coordination(process_group=group, timeout=5), WriteOptions(thread_count=2))
    assert kw["process_group"] is group and kw["timeout"] == 5 and kw["thread_count"] == 2
    assert set(kw) == {f.name for cls in (Coordination, WriteOptions) for f in dataclasses.fields(cls)}
    with pytest.raises(ValueError, match="'thread_count' is a field of more than one record"):
        as_keywords(WriteOptions(), ReadOptions())


# ----------------------------------------------------------------------------- the public calls

# The public signatures as they were before the records (names, order, defaults): unchanged.
ASYNC_SAVE = ["state_dict=None", "path=None", "checkpoint_id=None", "storage_writer=None", "planner=None",
              "process_group=None", "no_dist=False", "use_collectives=True", "coordinator_rank=0",
              "allow_pickle=False", "thread_count=1", "sync_files=True", "timeout=None", "user_metadata=None",
              "staging='eager'", "callback=None", "checkpointer=None", "use_gloo=True",
              "async_checkpointer_type=None", "async_stager=None"]
CHECKPOINTER_SAVE = ["self", *ASYNC_SAVE[:16], "use_gloo=True", "incremental=None", "pin_memory=None"]
MANAGER = ["self", "directory", "save_interval_steps=1", "keep_latest=None", "keep_every_steps=None",
           "keep_best=None", "best_metric=None", "best_mode='min'", "async_save=False", "incremental=False",
           "incremental_check='content'", "incremental_rehash_every=None", "process_group=None", "timeout=None",
           "storage_options=None", "local_dir=None", "local_interval_steps=None", "local_keep=2", "replicas=2",
           "node_rank=None", "replication_timeout=60.0"]


def _params(fn) -> list[str]:
    return [p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
            for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("fn, expected", [(async_save, ASYNC_SAVE), (AsyncCheckpointer.save, CHECKPOINTER_SAVE),
                                          (CheckpointManager.__init__, MANAGER)],
                         ids=["async_save", "AsyncCheckpointer.save", "CheckpointManager"])
def test_the_public_calls_keep_their_keywords(fn, expected):
    assert _params(fn) == expected


def test_every_keyword_of_an_async_save_lands_in_its_request():
    """A keyword added to ``AsyncCheckpointer.save`` without a place in the request would be dropped."""
    own = {f.name for f in dataclasses.fields(SaveRequest)}
    places = own | {f.name for cls in (Coordination, WriteOptions, AsyncOptions) for f in dataclasses.fields(cls)}
    keywords = {p for p in inspect.signature(AsyncCheckpointer.save).parameters if p not in ("self", "state_dict")}
    assert keywords <= places, sorted(keywords - places)
    values = {"path": "p", "planner": "planner", "no_dist": True, "timeout": 7, "thread_count": 2,
              "sync_files": False, "staging": "lazy", "pin_memory": False, "incremental": "inc"}
    request = SaveRequest.of(values)
    assert request.path == "p" and request.planner == "planner" and request.incremental == "inc"
    assert request.coordination == Coordination(no_dist=True, timeout=7)
    assert request.write == WriteOptions(thread_count=2, sync_files=False)
    assert request.options == AsyncOptions(staging="lazy", pin_memory=False)


def test_an_async_save_writes_what_its_keywords_ask_for(tmp_path):
    path = str(tmp_path / "ckpt")
    sd = plain(3)
    meta = async_save(sd, checkpoint_id=path, no_dist=True, thread_count=2, sync_files=False,
                      user_metadata={"run": "options"}, timeout=timedelta(seconds=30)).result()
    assert meta.user == {"run": "options"}
    # thread_count reaches the writer: one data file per thread
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) == 2
    out = load(plain(0), path, no_dist=True)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"]) and out["step"] == 3


@pytest.mark.parametrize("kwargs, error, message", [
    ({"staging": "later"}, ValueError, r"staging must be one of \('eager', 'lazy'\), got 'later'"),
    ({"state_dict": None}, ValueError, "async_save\\(\\) needs a state_dict"),
    ({"checkpoint_id": "elsewhere"}, ValueError, "disagree; pass one"),
    ({"path": None}, ValueError, "say where the checkpoint goes"),
    ({"timeout": -1}, ValueError, "timeout"),
])
def test_async_save_refuses_bad_keywords_before_it_writes_anything(tmp_path, kwargs, error, message):
    call = {"state_dict": plain(1), "path": str(tmp_path / "ckpt"), "no_dist": True, **kwargs}
    with pytest.raises(error, match=message):
        async_save(**call)
    assert os.listdir(tmp_path) == []


def test_the_manager_reads_its_keywords_back_from_its_records(tmp_path):
    local = tmp_path / "local"
    with CheckpointManager(str(tmp_path / "run"), save_interval_steps=2, keep_latest=3, keep_every_steps=10,
                           keep_best=1, best_metric="loss", best_mode="max", incremental=True,
                           incremental_check="version_counter", incremental_rehash_every=4, timeout=12,
                           local_dir=str(local), local_keep=3, replicas=1, replication_timeout=5) as mgr:
        assert (mgr.save_interval_steps, mgr.keep_latest, mgr.keep_every_steps, mgr.keep_best) == (2, 3, 10, 1)
        assert (mgr.best_metric, mgr.best_mode) == ("loss", "max")
        assert (mgr.incremental, mgr.incremental_check) == (True, "version_counter")
        assert mgr.timeout == timedelta(seconds=12) and mgr.process_group is None and mgr.async_save is False
        # the local tier gets the checked record: defaults filled in, the timeout a float
        assert mgr.local_tier.options == LocalTierOptions(local_dir=str(local), interval_steps=1, keep=3,
                                                          replicas=1, replication_timeout=5.0)
        assert isinstance(mgr.local_tier.options.replication_timeout, float)
        assert mgr.save(2, plain(2), metrics={"loss": 1.0}) is True
        assert mgr.save(3, plain(3)) is False  # the interval, from the retention record
        mgr.wait()
        assert [t.step for t in mgr.local_tier.timings] == [2, 3]  # local saves: interval 1, filled in
        target = plain(0)
        assert mgr.load(target) == 3 and target["step"] == 3  # the newest local step


@pytest.mark.parametrize("kwargs, error, message", [
    ({"save_interval_steps": 0}, ValueError, "save_interval_steps must be an int >= 1, got 0"),
    ({"keep_latest": 0}, ValueError, "keep_latest must be an int >= 1, got 0"),
    ({"keep_every_steps": True}, ValueError, "keep_every_steps must be an int >= 1, got True"),
    ({"best_mode": "mean"}, ValueError, "best_mode must be 'min' or 'max', got 'mean'"),
    ({"keep_best": 2}, ValueError, "keep_best needs best_metric"),
    ({"timeout": 0}, ValueError, "timeout"),
    ({"local_keep": 3}, ValueError, "^local_keep configures the local tier, which is off without local_dir"),
    ({"node_rank": 1, "local_interval_steps": 2, "replication_timeout": 5.0}, ValueError,
     "^local_interval_steps, node_rank, replication_timeout configure the local tier"),
    ({"local_dir": "L", "replicas": 0}, ValueError, "replicas must be an int >= 1, got 0"),
    ({"local_dir": "L", "local_interval_steps": 0}, ValueError, "local_interval_steps must be an int >= 1, got 0"),
    ({"local_dir": "L", "replication_timeout": 0}, ValueError,
     "replication_timeout must be a number of seconds > 0, got 0"),
    ({"async_save": "yes"}, TypeError, "async_save must be True, False or an AsyncCheckpointer, got 'yes'"),
    ({"async_save": AsyncCheckpointer(max_in_flight=2)}, ValueError, "max_in_flight=1 \\(this one has 2\\)"),
    ({"incremental_check": "version_counter"}, ValueError, "configure incremental saves, which are off"),
    ({"incremental": True, "incremental_check": "mtime"}, ValueError, "incremental_check must be one of"),
    ({"incremental": True, "incremental_rehash_every": 4}, ValueError,
     "incremental_rehash_every=4 configures incremental_check='version_counter'"),
])
def test_the_manager_refuses_bad_keywords_before_it_touches_the_directory(tmp_path, kwargs, error, message):
    kwargs = {k: str(tmp_path / v) if k == "local_dir" else v for k, v in kwargs.items()}
    with pytest.raises(error, match=message):
        CheckpointManager(str(tmp_path / "run"), **kwargs)
    assert os.listdir(tmp_path) == []  # neither the directory nor the local tier was made
