"""torch DCP's own objects as configuration: planners, storage, stagers (issue 32, item 2).

torch's ``DefaultSavePlanner``/``DefaultLoadPlanner``, ``FileSystemWriter``/``FileSystemReader``,
``FsspecWriter``/``FsspecReader``, ``DefaultStager``/``StagingOptions`` and
``AsyncCheckpointerType`` passed to this library's save/load/async_save do what they say; a
user's subclass carrying torch hooks runs them under save/load (torch's protocol) and is refused
by async_save, naming the class and what to override instead.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from helpers import assert_same, make_dtensor, make_tensor, stored_chunks, zeros_like_tree
from multiprocess import run_ranks
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as TorchFsspecReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as TorchFsspecWriter
from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
    FsspecWriter,
    StateDictMismatchError,
    UnsupportedValueError,
    async_save,
    load,
    save,
)
from hyper_parallel.core.distributed_checkpoint import default_planner as default_planner_face
from hyper_parallel.core.distributed_checkpoint._src.backends.torch_storage import as_our_reader, as_our_writer
from hyper_parallel.core.distributed_checkpoint._src.planning import torch_planners as StandIn  # noqa: N812
from hyper_parallel.core.distributed_checkpoint._src.planning.torch_planners import as_our_planner

CPU_STAGING = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                             use_non_blocking_copy=False)  # torch's non-blocking copy needs an accelerator


def small_sd() -> dict:
    return {"model": {"w": make_tensor((6, 4)), "b": make_tensor((4,), torch.bfloat16, seed=1)}, "step": 3}


# ---------------------------------------------------------------------------- planners


def test_ours_have_torchs_constructor_signature_and_defaults():
    import inspect

    for ours, theirs in ((DefaultSavePlanner, tdcp.DefaultSavePlanner), (DefaultLoadPlanner, tdcp.DefaultLoadPlanner)):
        params = lambda c: [(p.name, p.kind, p.default) for p in inspect.signature(c.__init__).parameters.values()]  # noqa: E731
        assert params(ours) == params(theirs)
    # the faces export torch's own classes and plan functions (code calling their methods gets torch's);
    # the stand-ins of ours (what an unmodified one becomes in save/load) keep torch's signatures
    assert default_planner_face.DefaultSavePlanner is tdcp.DefaultSavePlanner is DefaultSavePlanner
    assert default_planner_face.create_default_local_save_plan is tdcp.default_planner.create_default_local_save_plan
    for ours, theirs in ((StandIn.DefaultSavePlanner, tdcp.DefaultSavePlanner),
                         (StandIn.DefaultLoadPlanner, tdcp.DefaultLoadPlanner)):
        params = lambda c: [(p.name, p.kind, p.default) for p in inspect.signature(c.__init__).parameters.values()]  # noqa: E731
        assert params(ours) == params(theirs)
    assert StandIn.DefaultSavePlanner().enable_plan_caching is False  # torch's default, not StandardPlanner's


def test_torch_planner_instances_map_to_ours_with_their_options():
    save_p = as_our_planner(tdcp.DefaultSavePlanner(flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True,
                                                    enable_plan_caching=True), "save")
    assert type(save_p) is StandIn.DefaultSavePlanner
    assert (save_p.flatten_sharded_tensors, save_p.dedup_save_to_lowest_rank, save_p.enable_plan_caching) == (
        False, True, True)
    load_p = as_our_planner(tdcp.DefaultLoadPlanner(allow_partial_load=True), "load")
    assert type(load_p) is StandIn.DefaultLoadPlanner and load_p.allow_partial_load is True

    class OnlyOptions(tdcp.DefaultLoadPlanner):  # a subclass that sets options only is configuration too
        def __init__(self):
            super().__init__(allow_partial_load=True)

    assert as_our_planner(OnlyOptions(), "load").allow_partial_load is True


def test_save_with_torchs_planner_is_the_save_with_ours(tmp_path):
    sd = small_sd()
    save(sd, checkpoint_id=tmp_path / "torch", planner=tdcp.DefaultSavePlanner(), no_dist=True)
    save(sd, checkpoint_id=tmp_path / "ours", planner=DefaultSavePlanner(), no_dist=True)
    for name in ("torch", "ours"):
        target = zeros_like_tree(sd)
        load(target, checkpoint_id=tmp_path / name, planner=tdcp.DefaultLoadPlanner(), no_dist=True)
        assert_same(target, sd)
    theirs = tdcp.FileSystemReader(str(tmp_path / "torch"))  # the entries, in the format's words
    ours = load(storage_reader=theirs, no_dist=True)
    assert_same(ours, load(tmp_path / "ours"))


def test_the_callers_torch_load_planner_is_left_set_up_as_torch_leaves_it(tmp_path):
    """torch code reads planner.metadata / planner.state_dict after load (e.g. the version)."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    sd = small_sd()
    save(sd, tmp_path / "ours", no_dist=True)
    tdcp.save(sd, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    for name in ("ours", "torch"):  # our format (fast path) and torch's (its procedure)
        planner = tdcp.DefaultLoadPlanner()
        target = zeros_like_tree(sd)
        load(target, checkpoint_id=tmp_path / name, planner=planner, no_dist=True)
        assert_same(target, sd)
        assert planner.metadata.version == CURRENT_DCP_VERSION, name
        assert planner.metadata.state_dict_metadata["model.w"].size == torch.Size([6, 4]), name
        assert planner.state_dict["model.w"] is target["model"]["w"] and planner.original_state_dict is target


def test_load_assigns_top_level_values_back_as_torch_does(tmp_path):
    """torch's load ends with state_dict[key] = loaded for each value that is not Stateful."""

    class Watched(dict):
        def __init__(self, *args):
            super().__init__(*args)
            self.assigned: list[str] = []

        def __setitem__(self, key, value):
            self.assigned.append(key)
            super().__setitem__(key, value)

    class Counter:  # Stateful: loaded through load_state_dict, never assigned
        def __init__(self, n: int) -> None:
            self.n = n

        def state_dict(self) -> dict:
            return {"n": torch.tensor(self.n)}

        def load_state_dict(self, sd: dict) -> None:
            self.n = int(sd["n"])

    sd = small_sd()
    save({**sd, "counter": Counter(5)}, tmp_path, no_dist=True)
    target = Watched(zeros_like_tree(sd))
    counter = Counter(0)
    dict.__setitem__(target, "counter", counter)
    load(target, checkpoint_id=tmp_path, no_dist=True)
    assert sorted(set(target.assigned)) == ["model", "step"]
    assert target["counter"] is counter and counter.n == 5
    assert_same({k: v for k, v in target.items() if k != "counter"}, sd)


def test_allow_partial_load_leaves_missing_keys_as_they_are(tmp_path):
    sd = small_sd()
    save(sd, tmp_path, no_dist=True)
    target = zeros_like_tree(sd)
    target["model"]["new"] = torch.full((2,), 7.0)
    with pytest.raises(StateDictMismatchError, match="model.new"):
        load(target, checkpoint_id=tmp_path, planner=tdcp.DefaultLoadPlanner(), no_dist=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(target, checkpoint_id=tmp_path, planner=tdcp.DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    assert torch.equal(target["model"]["new"], torch.full((2,), 7.0))
    assert_same(target["model"]["w"], sd["model"]["w"])


def test_flatten_state_dict_false_is_honoured_where_it_means_the_same(tmp_path):
    flat = {"layer.weight": make_tensor((3, 3)), "step": 4}
    save(flat, tmp_path / "flat", planner=tdcp.DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    target = zeros_like_tree(flat)
    load(target, checkpoint_id=tmp_path / "flat", planner=DefaultLoadPlanner(flatten_state_dict=False))
    assert_same(target, flat)
    with pytest.raises(UnsupportedValueError, match=r"flatten_state_dict=False, but 'model' is a nested container "
                                                    r"\(holding 'model.w'\).*one pickled object"):
        save(small_sd(), tmp_path / "nested", planner=tdcp.DefaultSavePlanner(flatten_state_dict=False))
    save(small_sd(), tmp_path / "nested")
    with pytest.raises(UnsupportedValueError, match="load: flatten_state_dict=False, but 'model'"):
        load(zeros_like_tree(small_sd()), checkpoint_id=tmp_path / "nested",
             planner=tdcp.DefaultLoadPlanner(flatten_state_dict=False))


def test_subclasses_of_torch_planners_with_hooks_run_their_hooks(tmp_path):
    """A torch planner subclass that overrides a hook runs on torch's protocol (engine/protocol_run):
    its hooks are called; async_save, which cannot run them, still refuses it by name."""
    seen: list[str] = []

    class Filter(tdcp.DefaultSavePlanner):  # keeps "step" out of the checkpoint
        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            seen.append("set_up_planner")
            super().set_up_planner({k: v for k, v in state_dict.items() if k != "step"}, storage_meta,
                                   is_coordinator)

    class Scale(tdcp.DefaultLoadPlanner):
        def commit_tensor(self, read_item, tensor):
            tensor.mul_(10)

    save(small_sd(), tmp_path, planner=Filter(), no_dist=True)
    assert seen == ["set_up_planner"]
    assert "step" not in load(path=tmp_path)  # the checkpoint (torch's format) lacks the key
    target = zeros_like_tree(small_sd()["model"])
    load({"model": target}, checkpoint_id=tmp_path, planner=Scale(), no_dist=True)
    assert_same(target["w"], small_sd()["model"]["w"] * 10)
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    everything = load({}, checkpoint_id=tmp_path, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert_same(everything["model"], small_sd()["model"])
    with pytest.raises(UnsupportedValueError, match=r"planner=.*Filter subclasses torch.distributed.checkpoint's "
                                                    r"DefaultSavePlanner and overrides set_up_planner.*async_save"):
        async_save(small_sd(), tmp_path / "async", planner=Filter(), no_dist=True)


def test_dedup_save_to_lowest_rank_writes_whole_tensors_on_the_lowest_holder():
    from hyper_parallel.core.distributed_checkpoint._src.planning.planner import EntrySpec, SavePlan

    entries = {f"t{i}": EntrySpec("tensor", (f"t{i}",), "float32", (100 * (i + 1),)) for i in range(4)}
    plans = [SavePlan(entries, [], []) for _ in range(3)]  # every rank holds every tensor whole
    spread = StandIn.DefaultSavePlanner().create_global_save_plan(plans)
    lowest = StandIn.DefaultSavePlanner(dedup_save_to_lowest_rank=True).create_global_save_plan(plans)
    assert {e.store.writer for e in spread.entries.values()} == {0, 1, 2}
    assert {e.store.writer for e in lowest.entries.values()} == {0}
    assert [len(lowest[r].items) for r in range(3)] == [4, 0, 0]


# ---------------------------------------------------------------------------- storage


def test_torch_filesystem_writer_options_map_onto_ours(tmp_path):
    path = str(tmp_path / "ck")
    ours = as_our_writer(tdcp.FileSystemWriter(path, sync_files=False, thread_count=3, overwrite=False))
    assert type(ours) is FileSystemWriter
    assert (ours.path, ours.sync_files, ours.thread_count, ours.overwrite) == (path, False, 3, False)
    sd = {f"t{i}": make_tensor((32, 32), seed=i) for i in range(6)}
    save(sd, storage_writer=tdcp.FileSystemWriter(path, thread_count=3), no_dist=True)
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) == 3  # thread_count files per rank
    with pytest.raises(CheckpointError, match="overwrite=False"):
        save(sd, storage_writer=tdcp.FileSystemWriter(path, overwrite=False), no_dist=True)
    target = zeros_like_tree(sd)
    load(target, storage_reader=tdcp.FileSystemReader(path), no_dist=True)
    assert_same(target, sd)
    assert type(as_our_reader(tdcp.FileSystemReader(path))) is FileSystemReader


def test_checkpoint_id_repoints_a_torch_writer_as_torch_does(tmp_path):
    writer, reader = tdcp.FileSystemWriter(str(tmp_path / "a")), tdcp.FileSystemReader(str(tmp_path / "a"))
    save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "b"), storage_writer=writer, no_dist=True)
    assert os.path.exists(tmp_path / "b" / ".metadata") and not os.path.exists(tmp_path / "a")
    out = {"w": torch.zeros(3)}
    load(out, checkpoint_id=str(tmp_path / "b"), storage_reader=reader, no_dist=True)
    assert torch.equal(out["w"], torch.ones(3))


def test_torch_writer_options_without_a_counterpart_are_refused(tmp_path):
    class Compress:  # stands for torch's ZStandard extension (which needs zstandard installed)
        pass

    # a file per tensor (torch's single_file_per_rank=False) is taken: the same data, our files
    save({"w": torch.ones(2)}, storage_writer=tdcp.FileSystemWriter(str(tmp_path / "f"), single_file_per_rank=False),
         no_dist=True)
    got = {"w": torch.zeros(2)}
    load(got, checkpoint_id=str(tmp_path / "f"), no_dist=True)
    assert torch.equal(got["w"], torch.ones(2))
    with pytest.raises(UnsupportedValueError, match="_extensions=.*compression.*Pass no _extensions"):
        save({"w": torch.ones(2)}, storage_writer=tdcp.FileSystemWriter(str(tmp_path), _extensions=[Compress()]))
    # knobs of torch's own writer loop, with nothing to change here, are accepted
    save({"w": torch.ones(2)}, storage_writer=tdcp.FileSystemWriter(
        str(tmp_path), per_thread_copy_ahead=1 << 20, cache_staged_state_dict=True), no_dist=True)


def test_subclasses_of_torch_storage_with_hooks_run_their_hooks(tmp_path):
    calls: list[str] = []

    class Uploading(tdcp.FileSystemWriter):
        def write_data(self, plan, planner):
            calls.append("write_data")
            return super().write_data(plan, planner)

    class Reading(tdcp.FileSystemReader):
        def read_data(self, plan, planner):
            calls.append("read_data")
            return super().read_data(plan, planner)

    save({"w": torch.ones(2)}, storage_writer=Uploading(str(tmp_path)), no_dist=True)
    out = {"w": torch.zeros(2)}
    load(out, storage_reader=Reading(str(tmp_path)), no_dist=True)
    assert calls == ["write_data", "read_data"] and torch.equal(out["w"], torch.ones(2))
    with pytest.raises(UnsupportedValueError, match=r"storage_writer=.*Uploading subclasses .*FileSystemWriter and "
                                                    r"overrides write_data.*async_save.*StorageWriter ABC"):
        async_save({"w": torch.ones(2)}, storage_writer=Uploading(str(tmp_path / "async")), no_dist=True)


def test_torch_fsspec_storage_maps_with_its_url_and_storage_options(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/ck"
    writer = TorchFsspecWriter(url, thread_count=2, overwrite=False, **options)
    ours = as_our_writer(writer)
    assert type(ours) is FsspecWriter and ours.url == url and ours.thread_count == 2 and ours.overwrite is False
    assert ours._options["client_kwargs"]["endpoint_url"] == options["client_kwargs"]["endpoint_url"]
    sd = small_sd()
    save(sd, storage_writer=writer, no_dist=True)
    target = zeros_like_tree(sd)
    load(target, storage_reader=TorchFsspecReader(url, **options), no_dist=True)
    assert_same(target, sd)
    with pytest.raises(CheckpointError, match="overwrite=False"):
        save(sd, storage_writer=TorchFsspecWriter(url, overwrite=False, **options), no_dist=True)


# ---------------------------------------------------------------------------- async


def test_async_save_with_torchs_async_stager_returns_torchs_response_shape(tmp_path):
    sd = {"w": make_tensor((64, 64))}
    expected = sd["w"].clone()
    stager = DefaultStager(CPU_STAGING)
    try:
        resp = async_save(sd, checkpoint_id=str(tmp_path), storage_writer=tdcp.FileSystemWriter(str(tmp_path)),
                          planner=tdcp.DefaultSavePlanner(), async_stager=stager,
                          async_checkpointer_type=AsyncCheckpointerType.PROCESS, no_dist=True)
        assert resp.staging == "lazy"
        assert resp.staging_completion.result(timeout=60) is None
        sd["w"].add_(1)  # after staging completed: the snapshot keeps the old values
        seen = []
        resp.add_done_callback(lambda f: seen.append(f.result() is not None))
        resp.upload_completion.result(timeout=120)
        assert resp.done() and not resp.running() and resp.cancel() is False
    finally:
        stager.close()
    assert seen == [True]  # called once done; result() returned at once inside it
    out = {"w": torch.zeros(64, 64)}
    load(out, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(out["w"], expected)


def test_blocking_stagers_stage_eagerly_and_custom_stagers_are_refused(tmp_path):
    sd = {"w": make_tensor((8, 8))}
    for stager in (BlockingAsyncStager(), DefaultStager(StagingOptions(False, False, False, False))):
        resp = async_save(sd, checkpoint_id=str(tmp_path / type(stager).__name__), async_stager=stager, no_dist=True)
        assert resp.staging == "eager" and resp.staged()
        resp.result(timeout=120)

    class Mine(BlockingAsyncStager):
        def stage(self, state_dict):
            return state_dict

    with pytest.raises(UnsupportedValueError, match=r"async_stager=.*Mine: a custom stager is not run here"):
        async_save(sd, checkpoint_id=str(tmp_path / "x"), async_stager=Mine(), no_dist=True)
    with pytest.raises(ValueError, match="AsyncCheckpointerType"):
        async_save(sd, checkpoint_id=str(tmp_path / "x"), async_checkpointer_type="fork", no_dist=True)


# ---------------------------------------------------------------------------- two gloo ranks


def _two_ranks(rank: int, ws: int, root: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    sd = {"model": {"s0": make_dtensor(make_tensor((7, 5), seed=1), mesh, [Shard(0)]),
                    "s1": make_dtensor(make_tensor((3, 9), torch.bfloat16, seed=2), mesh, [Shard(1)]),
                    "rep": make_dtensor(make_tensor((4, 4), seed=3), mesh, [Replicate()]),
                    **{f"plain{i}": make_tensor((3 + i, 2), seed=10 + i) for i in range(3)}},
          "step": 3}
    d = {k: os.path.join(root, k) for k in ("ours", "torch_objs", "lowest", "torch_dcp", "async")}
    save(sd, storage_writer=FileSystemWriter(d["ours"], thread_count=2), planner=DefaultSavePlanner())
    meta = save(sd, checkpoint_id=d["torch_objs"], planner=tdcp.DefaultSavePlanner(),
                storage_writer=tdcp.FileSystemWriter(d["torch_objs"], thread_count=2))
    lowest = save(sd, checkpoint_id=d["lowest"], planner=tdcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    writers = lambda m: {r for k in ("rep", *[f"plain{i}" for i in range(3)])  # noqa: E731
                         for _, r, _ in stored_chunks(m, f"model.{k}")}
    assert writers(meta) == {0, 1} and writers(lowest) == {0}, (writers(meta), writers(lowest))
    tdcp.save(sd, checkpoint_id=d["torch_dcp"])  # torch's own save and load, for the values it gives
    theirs = zeros_like_tree(sd)
    tdcp.load(theirs, checkpoint_id=d["torch_dcp"])
    assert_same(theirs, sd)
    for name in ("ours", "torch_objs", "lowest"):
        target = zeros_like_tree(sd)
        load(target, storage_reader=tdcp.FileSystemReader(d[name]), planner=tdcp.DefaultLoadPlanner())
        assert_same(target, theirs)
    # allow_partial_load: a key the checkpoint lacks keeps its value, as in torch
    extra = {"model": {**zeros_like_tree(sd["model"]), "new": torch.full((2,), 5.0)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(extra, checkpoint_id=d["ours"], planner=tdcp.DefaultLoadPlanner(allow_partial_load=True))
    torch_extra = {"model": {**zeros_like_tree(sd["model"]), "new": torch.full((2,), 5.0)}}
    tdcp.load(torch_extra, checkpoint_id=d["torch_dcp"], planner=tdcp.DefaultLoadPlanner(allow_partial_load=True))
    assert_same(extra, torch_extra)
    # async save with torch's stager, checkpointer type and objects; training changes tensors once staged
    stager = DefaultStager(CPU_STAGING)
    before = zeros_like_tree(sd)
    for k, v in sd["model"].items():
        before["model"][k] = v.clone() if not hasattr(v, "to_local") else zeros_like_tree(v)
        if hasattr(v, "to_local"):
            before["model"][k].to_local().copy_(v.to_local())
    resp = async_save(sd, checkpoint_id=d["async"], storage_writer=tdcp.FileSystemWriter(d["async"]),
                      planner=tdcp.DefaultSavePlanner(), async_stager=stager,
                      async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    resp.staging_completion.result(timeout=60)
    for v in sd["model"].values():
        (v.to_local() if hasattr(v, "to_local") else v).add_(1)
    resp.upload_completion.result(timeout=120)
    stager.close()
    target = zeros_like_tree(sd)
    load(target, checkpoint_id=d["async"], planner=tdcp.DefaultLoadPlanner())
    assert_same(target["model"], before["model"])
    return True


def test_torch_objects_on_two_gloo_ranks_match_ours_and_torchs_own(tmp_path):
    assert run_ranks(_two_ranks, 2, str(tmp_path), timeout_s=240) == [True, True]
