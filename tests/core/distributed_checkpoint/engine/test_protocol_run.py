"""Planners and storage objects on torch DCP's protocol run under our save/load (engine/protocol_run).

Each hook is called in torch 2.13's order (checked against stock torch running the same
recording objects, in one process and on 2 gloo ranks), with torch's semantics: torch's
``_EmptyStateDictLoadPlanner``, a renaming planner, a planner transforming tensors in
``resolve_tensor``/``commit_tensor``, a ``FileSystemWriter`` subclass with a file system of its
own, a reader that builds ``Metadata`` itself, HyperParallel's newer protocol names; a hook that
fails on one rank fails every rank naming it.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from concurrent.futures import Future

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from helpers import assert_same, local_expected, make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import RankFailedError, load, save


def small_sd() -> dict:
    return {"model": {"w": make_tensor((6, 4)), "b": make_tensor((4,), torch.bfloat16, seed=1)},
            "extra": {"step": 3, "name": "run"}}


def torch_save(sd: dict, path: str, **kwargs) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: no process group, one process
        tdcp.save(sd, checkpoint_id=path, no_dist=True, **kwargs)


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


# ---------------------------------------------------------------------------- call order


def _recording(cls: type, log: list[str], hooks: tuple[str, ...]) -> type:
    """A subclass of torch's ``cls`` that logs each hook's name, then runs torch's own."""
    def wrap(name: str):
        def hook(self, *args, **kwargs):
            log.append(name)
            return getattr(super(sub, self), name)(*args, **kwargs)
        hook.__name__ = name
        return hook

    sub = type(f"Recording{cls.__name__}", (cls,), {h: wrap(h) for h in hooks})
    return sub


SAVE_PLANNER_HOOKS = ("set_up_planner", "create_local_plan", "create_global_plan", "finish_plan", "resolve_data")
WRITER_HOOKS = ("reset", "storage_meta", "set_up_storage_writer", "prepare_local_plan", "prepare_global_plan",
                "write_data", "finish")
LOAD_PLANNER_HOOKS = ("set_up_planner", "create_local_plan", "create_global_plan", "finish_plan", "resolve_tensor",
                      "commit_tensor", "load_bytes")
READER_HOOKS = ("reset", "read_metadata", "set_up_storage_reader", "prepare_local_plan", "prepare_global_plan",
                "read_data")


def _save_and_load_logs(fns: tuple, path: str, sd: dict, target: dict, **kwargs) -> tuple[list[str], list[str]]:
    """The hooks one save and one load called, in order, with ``fns`` = (save, load)."""
    save_fn, load_fn = fns
    saved: list[str] = []
    planner = _recording(tdcp.DefaultSavePlanner, saved, SAVE_PLANNER_HOOKS)()
    writer = _recording(tdcp.FileSystemWriter, saved, WRITER_HOOKS)(path)
    quiet(save_fn, sd, checkpoint_id=path, storage_writer=writer, planner=planner, **kwargs)
    loaded: list[str] = []
    planner = _recording(tdcp.DefaultLoadPlanner, loaded, LOAD_PLANNER_HOOKS)()
    reader = _recording(tdcp.FileSystemReader, loaded, READER_HOOKS)(path)
    quiet(load_fn, target, checkpoint_id=path, storage_reader=reader, planner=planner, **kwargs)
    return saved, loaded


def test_hooks_are_called_in_torchs_order_in_one_process(tmp_path):
    sd = small_sd()
    theirs = _save_and_load_logs((tdcp.save, tdcp.load), str(tmp_path / "torch"), sd,
                                 {"model": {"w": torch.zeros(6, 4)}}, no_dist=True)
    target = {"model": {"w": torch.zeros(6, 4)}}
    ours = _save_and_load_logs((save, load), str(tmp_path / "ours"), sd, target, no_dist=True)
    assert ours == theirs
    assert ours[0][:6] == ["reset", "storage_meta", "set_up_planner", "set_up_storage_writer", "create_local_plan",
                           "prepare_local_plan"]
    assert "finish" in ours[0] and "read_metadata" in ours[1]
    assert torch.equal(target["model"]["w"], sd["model"]["w"])


def rank_hook_orders(rank: int, ws: int, root: str) -> tuple:
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("x",))
    sd = {"w": make_dtensor(make_tensor((7, 4)), mesh, [Shard(0)]), "r": make_tensor((3,), seed=2), "step": 5}

    def target() -> dict:
        return {"w": make_dtensor(torch.zeros(7, 4), mesh, [Shard(1)]), "r": torch.zeros(3), "step": 0}

    theirs = _save_and_load_logs((tdcp.save, tdcp.load), os.path.join(root, "torch"), sd, target())
    mine = target()
    ours = _save_and_load_logs((save, load), os.path.join(root, "ours"), sd, mine)
    ok = torch.equal(mine["w"].to_local(), local_expected(make_tensor((7, 4)), mesh, [Shard(1)])) and \
        mine["step"] == 5 and torch.equal(mine["r"], make_tensor((3,), seed=2))
    return ours, theirs, ok


def test_hooks_are_called_in_torchs_order_on_each_of_two_ranks(tmp_path):
    for rank, (ours, theirs, ok) in enumerate(run_ranks(rank_hook_orders, 2, str(tmp_path))):
        assert ours == theirs, f"rank {rank}"
        assert ok, f"rank {rank}: loaded values differ"
        assert ("create_global_plan" in ours[0]) == (rank == 0)  # the coordinator's step alone
        assert ("finish" in ours[0]) == (rank == 0)


# ---------------------------------------------------------------------------- planners with code of their own


def test_torchs_empty_state_dict_planner_loads_everything(tmp_path):
    path = str(tmp_path / "ck")
    torch_save(small_sd(), path)
    everything = load({}, checkpoint_id=path, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert_same(everything, small_sd())
    some = load({}, checkpoint_id=path, planner=_EmptyStateDictLoadPlanner(keys={"model.w"}), no_dist=True)
    assert list(some) == ["model"] and list(some["model"]) == ["w"]


class Renaming(tdcp.DefaultLoadPlanner):
    """Loads target keys from checkpoint keys of other names (``mapping``: target -> checkpoint)."""

    def __init__(self, mapping: dict[str, str]):
        super().__init__(flatten_state_dict=False)
        self.mapping, self.planned = mapping, []

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        super().set_up_planner({self.mapping.get(k, k): v for k, v in state_dict.items()}, metadata, is_coordinator)

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.planned.append(sorted({item.dest_index.fqn for item in plan.items}))
        return plan


class Transforming(tdcp.DefaultLoadPlanner):
    """Reads every tensor into a float64 buffer of its own and commits it doubled into the target."""

    def __init__(self):
        super().__init__()
        self.buffers = {}

    def resolve_tensor(self, read_item):
        target = super().resolve_tensor(read_item)
        buf = torch.empty(target.shape, dtype=torch.float64)
        self.buffers[read_item.dest_index] = (target, buf)
        return buf

    def commit_tensor(self, read_item, tensor):
        target, buf = self.buffers.pop(read_item.dest_index)
        assert tensor.data_ptr() == buf.data_ptr()  # torch's readers pass a detached view of it
        target.copy_(buf * 2)


def test_a_renaming_planner_runs_its_hooks(tmp_path):
    path = str(tmp_path / "ck")
    torch_save({"w": make_tensor((6, 4)), "step": 3}, path)
    planner = Renaming({"encoder.weight": "w", "counter": "step"})
    target = {"encoder.weight": torch.zeros(6, 4), "counter": 0}
    load(target, checkpoint_id=path, planner=planner, no_dist=True)
    assert planner.planned == [["step", "w"]]
    assert torch.equal(target["encoder.weight"], make_tensor((6, 4)))


def test_a_planner_transforming_tensors_in_resolve_and_commit_runs_them(tmp_path):
    path = str(tmp_path / "ck")
    torch_save(small_sd(), path)
    target = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4, dtype=torch.bfloat16)}}
    planner = Transforming()
    load(target, checkpoint_id=path, planner=planner, no_dist=True)
    assert not planner.buffers
    assert torch.equal(target["model"]["w"], small_sd()["model"]["w"] * 2)
    assert torch.equal(target["model"]["b"], (small_sd()["model"]["b"].double() * 2).bfloat16())


def test_torch_protocol_planners_load_a_checkpoint_of_our_format(tmp_path):
    path = str(tmp_path / "ours")
    save(small_sd(), path)
    target = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4, dtype=torch.bfloat16)}}
    load(target, checkpoint_id=path, planner=Transforming(), no_dist=True)
    assert torch.equal(target["model"]["w"], small_sd()["model"]["w"] * 2)
    renamed = {"weight": torch.zeros(6, 4)}
    load(renamed, checkpoint_id=path, planner=Renaming({"weight": "model.w"}), no_dist=True)
    assert torch.equal(renamed["weight"], small_sd()["model"]["w"])
    assert_same(load({}, checkpoint_id=path, planner=_EmptyStateDictLoadPlanner(), no_dist=True), small_sd())


# ---------------------------------------------------------------------------- storage with code of its own


class CountingFileSystem(FileSystem):
    """torch's local file system, counting the streams it opens."""

    def __init__(self):
        super().__init__()
        self.opened: list[tuple[str, str]] = []

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        self.opened.append((os.path.basename(str(path)), mode))
        with super().create_stream(path, mode) as stream:
            yield stream


class CountingWriter(tdcp.FileSystemWriter):
    def __init__(self, path: str):
        super().__init__(path)
        self.fs = CountingFileSystem()
        self.finished: list[int] = []

    def finish(self, metadata, results):
        self.finished.append(len(results))
        super().finish(metadata, results)


def test_a_writer_with_a_file_system_of_its_own_writes_through_it(tmp_path):
    path = str(tmp_path / "ck")
    writer = CountingWriter(path)
    meta = save(small_sd(), storage_writer=writer, no_dist=True)
    assert isinstance(meta, Metadata) and sorted(meta.state_dict_metadata) == ["extra.name", "extra.step", "model.b",
                                                                              "model.w"]
    assert writer.finished == [1]
    assert ("__0_0.distcp", "wb") in writer.fs.opened and (".metadata.tmp", "wb") in writer.fs.opened
    assert_same(load(path=path), small_sd())
    stock = {"model": {"w": torch.zeros(6, 4)}}
    quiet(tdcp.load, stock, checkpoint_id=path)  # torch's format: stock torch reads it
    assert torch.equal(stock["model"]["w"], small_sd()["model"]["w"])


class MemoryReader(tdcp.StorageReader):
    """A reader on torch's protocol that builds ``Metadata`` itself from tensors and values held in memory."""

    def __init__(self, values: dict):
        self.values, self.calls = values, []

    def reset(self, checkpoint_id=None):
        self.calls.append("reset")

    def read_metadata(self, *args, **kwargs):
        sdm = {}
        for k, v in self.values.items():
            if isinstance(v, torch.Tensor):
                sdm[k] = TensorStorageMetadata(TensorProperties(dtype=v.dtype), v.size(),
                                               [ChunkStorageMetadata(torch.Size([0] * v.dim()), v.size())])
            else:
                sdm[k] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=sdm, planner_data=None, storage_data={})

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        self.calls.append(("set_up_storage_reader", is_coordinator, kwargs.get("rank")))

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        for item in plan.items:
            value = self.values[item.storage_index.fqn]
            if item.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(value, buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            for dim, (o, n) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                value = value.narrow(dim, o, n)
            target = planner.resolve_tensor(item).detach()
            target.copy_(value)
            planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return True


def test_a_reader_that_builds_metadata_itself_loads(tmp_path):
    reader = MemoryReader({"w": make_tensor((5, 3)), "step": 9})
    target = {"w": torch.zeros(5, 3), "step": 0}
    load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["w"], make_tensor((5, 3))) and target["step"] == 9
    assert reader.calls == [("set_up_storage_reader", True, 0)]
    assert load({}, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)["step"] == 9


# ---------------------------------------------------------------------------- HyperParallel's newer names


class HyperParallelLoadPlanner:
    """A planner in HyperParallel's newer names, doing the work with torch's default planner."""

    def __init__(self):
        self.inner, self.calls = tdcp.DefaultLoadPlanner(), []

    def configure_planner(self, state_dict, metadata=None, **kwargs):
        self.calls.append("configure_planner")
        self.rank = kwargs.get("rank", 0)
        self.inner.set_up_planner(state_dict, metadata, kwargs.get("is_coordinator", False))

    def build_local_plan(self):
        return self.inner.create_local_plan()

    def build_global_plan(self, all_plans):
        self.calls.append(f"build_global_plan({len(all_plans)})")
        return all_plans[self.rank]

    def finalize_plan(self, plan):
        return plan

    def acquire_tensor(self, read_item):
        return self.inner.resolve_tensor(read_item)

    def apply_tensor(self, read_item, tensor):
        self.calls.append("apply_tensor")

    def apply_bytes(self, read_item, value):
        self.calls.append("apply_bytes")
        obj = torch.load(io.BytesIO(value), weights_only=True)
        set_element(self.inner.original_state_dict, self.inner.mappings[read_item.dest_index.fqn], obj)


class HyperParallelSavePlanner:
    def __init__(self):
        self.inner, self.calls = tdcp.DefaultSavePlanner(), []

    def configure_planner(self, state_dict, **kwargs):
        self.calls.append(("configure_planner", kwargs.get("rank"), kwargs.get("use_collectives")))
        self.rank = kwargs.get("rank", 0)
        self.inner.set_up_planner(state_dict, is_coordinator=kwargs.get("is_coordinator", False))

    def build_local_plan(self):
        return self.inner.create_local_plan()

    def build_global_plan(self, all_plans):
        plans, metadata = self.inner.create_global_plan(all_plans)
        return plans[self.rank], metadata

    def finalize_plan(self, plan):
        return self.inner.finish_plan(plan)

    def get_data(self, item):
        data = self.inner.resolve_data(item)
        return data.getvalue() if isinstance(data, io.BytesIO) else data


class HyperParallelReader:
    """A storage reader in HyperParallel's newer names, serving a torch-written checkpoint through torch's reader."""

    def __init__(self, path: str):
        self.inner, self.calls = tdcp.FileSystemReader(path), []

    def load_metadata(self, **kwargs):
        self.calls.append("load_metadata")
        return self.inner.read_metadata()  # our own file in this test

    def configure_reader(self, metadata, is_coordinator=False, rank=None):
        self.calls.append(("configure_reader", is_coordinator, rank))
        self.inner.set_up_storage_reader(metadata, is_coordinator)

    def execute_read(self, plan, planner, broadcast_groups=None, broadcast_batch_bytes=0):
        self.calls.append("execute_read")
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                continue
            target = planner.acquire_tensor(item)
            stored = self._stored(item.storage_index)
            for dim, (o, n) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                stored = stored.narrow(dim, o, n)
            target.copy_(stored)
            planner.apply_tensor(item, target)

    def _stored(self, index):
        info = self.inner.storage_data[index]
        with open(os.path.join(self.inner.path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            return torch.load(io.BytesIO(f.read(info.length)), weights_only=True)


def test_hyper_parallels_newer_protocol_names_run(tmp_path):
    path = str(tmp_path / "ck")
    planner = HyperParallelSavePlanner()
    save(small_sd(), path, planner=planner, no_dist=True)  # our writer becomes torch's: torch's format
    assert planner.calls == [("configure_planner", 0, True)]
    loader = HyperParallelLoadPlanner()
    target = {"model": {"w": torch.zeros(6, 4)}, "extra": {"step": 0}}
    load(target, checkpoint_id=path, planner=loader, no_dist=True)  # read by our torch-format reader
    assert torch.equal(target["model"]["w"], small_sd()["model"]["w"]) and target["extra"]["step"] == 3
    assert loader.calls[:2] == ["configure_planner", "build_global_plan(1)"] and "apply_bytes" in loader.calls
    reader = HyperParallelReader(path)
    target = {"model": {"w": torch.zeros(6, 4)}}
    load(target, storage_reader=reader, no_dist=True)  # a seed reader with torch's default planner
    assert torch.equal(target["model"]["w"], small_sd()["model"]["w"])
    assert reader.calls == ["load_metadata", ("configure_reader", True, 0), "execute_read"]
    both = HyperParallelLoadPlanner()
    target = {"model": {"b": torch.zeros(4, dtype=torch.bfloat16)}}
    load(target, storage_reader=HyperParallelReader(path), planner=both, no_dist=True)
    assert torch.equal(target["model"]["b"], small_sd()["model"]["b"]) and "apply_tensor" in both.calls


# ---------------------------------------------------------------------------- two ranks: plans, results, failures


class FailingOnRankOne(tdcp.DefaultLoadPlanner):
    def create_local_plan(self):
        if torch.distributed.get_rank() == 1:
            raise ValueError("planner broke on purpose")
        return super().create_local_plan()


def rank_protocol_objects(rank: int, ws: int, root: str) -> dict:
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("x",))
    full = make_tensor((9, 4), seed=7)
    sd = {"w": make_dtensor(full, mesh, [Shard(0)]), "b": make_tensor((3,), seed=8), "step": 4}
    out: dict = {}
    writer = CountingWriter(os.path.join(root, "counted"))
    save(sd, storage_writer=writer)
    out["finished"], out["opened"] = writer.finished, sorted(n for n, _ in writer.fs.opened)
    target = {"w": make_dtensor(torch.zeros(9, 4), mesh, [Replicate()]), "b": torch.zeros(3), "step": 0}
    load(target, checkpoint_id=os.path.join(root, "counted"), planner=Transforming())
    out["transformed"] = torch.equal(target["w"].to_local(), full * 2) and target["step"] == 4
    stock = {"w": make_dtensor(torch.zeros(9, 4), mesh, [Shard(1)])}
    tdcp.load(stock, checkpoint_id=os.path.join(root, "counted"))  # stock torch reads what our run wrote
    out["stock"] = torch.equal(stock["w"].to_local(), local_expected(full, mesh, [Shard(1)]))
    seed = HyperParallelSavePlanner()
    save(sd, os.path.join(root, "seed"), planner=seed)  # HyperParallel's every-rank global step
    back = {"w": make_dtensor(torch.zeros(9, 4), mesh, [Shard(1)]), "step": 0}
    loader = HyperParallelLoadPlanner()
    load(back, checkpoint_id=os.path.join(root, "seed"), planner=loader)
    out["seed"] = (torch.equal(back["w"].to_local(), local_expected(full, mesh, [Shard(1)])) and back["step"] == 4,
                   seed.calls, loader.calls[:2])
    memory = MemoryReader({"w": full, "step": 11})
    into = {"w": make_dtensor(torch.zeros(9, 4), mesh, [Shard(0)]), "step": 0}
    load(into, storage_reader=memory)
    out["memory"] = torch.equal(into["w"].to_local(), local_expected(full, mesh, [Shard(0)])) and into["step"] == 11
    try:
        load({"b": torch.zeros(3)}, checkpoint_id=os.path.join(root, "counted"), planner=FailingOnRankOne())
    except RankFailedError as exc:
        out["failure"] = (sorted(exc.failures), str(exc), type(exc.failures[1][0]).__name__, str(exc.failures[1][0]))
    return out


def test_protocol_objects_on_two_gloo_ranks(tmp_path):
    results = run_ranks(rank_protocol_objects, 2, str(tmp_path))
    for rank, out in enumerate(results):
        assert out["finished"] == ([2] if rank == 0 else [])  # finish on the coordinator, with both ranks' results
        assert f"__{rank}_0.distcp" in out["opened"]
        assert (".metadata.tmp" in out["opened"]) == (rank == 0)
        assert out["transformed"] and out["stock"] and out["memory"], rank
        ok, seed_calls, loader_calls = out["seed"]
        assert ok and seed_calls == [("configure_planner", rank, True)] and loader_calls == [
            "configure_planner", "build_global_plan(2)"]
        ranks, message, kind, text = out["failure"]
        assert ranks == [1] and "planner broke on purpose" in message and "load (local plan)" in message
        # torch's shape on every rank: failures[rank] = (the rank's own exception, its stack)
        assert (kind, text) == ("ValueError", "planner broke on purpose"), rank


class FailingWriter(tdcp.FileSystemWriter):
    """A writer whose chosen hook fails, as torch's own failure tests make them."""

    def __init__(self, path: str, hook: str) -> None:
        super().__init__(path)
        self.hook = hook

    def _fail(self, name: str) -> None:
        if name == self.hook:
            raise ValueError(f"{name} failed on purpose")

    def set_up_storage_writer(self, *args, **kwargs):
        self._fail("set_up_storage_writer")
        return super().set_up_storage_writer(*args, **kwargs)

    def prepare_global_plan(self, plans):
        self._fail("prepare_global_plan")
        return super().prepare_global_plan(plans)

    def write_data(self, plan, planner):
        self._fail("write_data")
        return super().write_data(plan, planner)

    def finish(self, metadata, results):
        self._fail("finish")
        return super().finish(metadata, results)


def test_a_hooks_error_in_one_process_is_torchs_checkpoint_exception(tmp_path):
    """torch raises a hook's error as CheckpointException(failures={rank: (exc, stack)}) also
    with no_dist=True; so do we, for code of the caller's (ours stay what they are)."""
    from torch.distributed.checkpoint.api import CheckpointException

    for hook in ("set_up_storage_writer", "prepare_global_plan", "write_data", "finish"):
        with pytest.raises(CheckpointException) as info:
            save(small_sd(), storage_writer=FailingWriter(str(tmp_path / hook), hook), no_dist=True)
        assert isinstance(info.value, RankFailedError) and list(info.value.failures) == [0], hook
        exc, stack = info.value.failures[0]
        assert type(exc) is ValueError and str(exc) == f"{hook} failed on purpose" and len(stack) >= 1
        assert f"{hook} failed on purpose" in info.value.failures[0] and hook in str(info.value)
        assert not (tmp_path / hook / ".metadata").exists()  # nothing committed
