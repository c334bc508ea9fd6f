"""HyperParallel's planner calls on StandardPlanner (planning/seed_plans.py): the plans it builds,
the metadata, the checks, the plan cache, byte values, and on 2 gloo ranks a save and load driven
through those calls with replicated shards read once and broadcast."""

from __future__ import annotations

import os
import pickle
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import StandardPlanner, filesystem_storage, standard_planner, util
from hyper_parallel.core.distributed_checkpoint._src.base.errors import (
    CorruptCheckpointError,
    StateDictMismatchError,
    UnsupportedValueError,
)
from hyper_parallel.core.distributed_checkpoint._src.planning.hyper_parallel_protocol import is_hyper_parallel_planner
from hyper_parallel.core.distributed_checkpoint.metadata import (
    CHUNK_INFO,
    BytesStorageMetadata,
    ChunkInfo,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, SavePlan, WriteItemType


def _saved(fqn: str, shape: tuple, chunks: list[tuple[tuple, tuple]], dtype: str = "torch.float32") -> Metadata:
    return Metadata(state_dict_metadata={fqn: TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype), size=torch.Size(shape),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks])})


def test_our_planner_answers_hyperparallel_names_and_still_plans_as_ours():
    planner = StandardPlanner()
    assert callable(planner.configure_planner) and callable(planner.build_global_plan)
    assert not is_hyper_parallel_planner(planner)  # save()/load() keep running it on our own procedure


def test_a_save_plan_holds_a_write_item_per_tensor_chunk_and_one_per_other_value():
    part = torch.ones(2, 3)
    setattr(part, CHUNK_INFO, ChunkInfo(chunk=ChunkStorageMetadata(torch.Size((2, 0)), torch.Size((2, 3))),
                                        global_shape=(4, 3)))
    planner = StandardPlanner()
    planner.configure_planner({"model": {"w": torch.zeros(4, 5), "part": part}, "step": 7}, rank=0)
    plan = planner.build_local_plan()
    by_key = {item.index.fqn: item for item in plan.items}
    assert set(by_key) == {"model.w", "model.part", "step"}
    assert by_key["step"].type == WriteItemType.BYTE_IO
    w = by_key["model.w"].tensor_data
    assert (tuple(w.chunk.offsets), tuple(w.chunk.sizes), tuple(w.size)) == ((0, 0), (4, 5), (4, 5))
    assert w.properties.dtype == "torch.float32"
    p = by_key["model.part"].tensor_data
    assert (tuple(p.chunk.offsets), tuple(p.size)) == ((2, 0), (4, 3))
    assert plan.planner_data["model.w"] == ("model", "w")  # the flattened key's path


def test_the_global_save_plan_numbers_chunks_keeps_one_copy_and_describes_every_tensor():
    planners = []
    for rank in (0, 1):
        planner = StandardPlanner()
        planner.configure_planner({"shared": torch.zeros(3), f"own{rank}": torch.zeros(2)}, rank=rank)
        planners.append(planner)
    plans = [p.build_local_plan() for p in planners]
    results = [p.build_global_plan(plans) for p in planners]
    written = [sorted(item.index.fqn for item in plan.items) for plan, _ in results]
    assert sorted(written[0] + written[1]) == ["own0", "own1", "shared"]  # the replica is written once
    metadata = results[0][1]
    assert set(metadata.state_dict_metadata) == {"shared", "own0", "own1"}
    assert len(metadata.state_dict_metadata["shared"].chunks) == 1
    assert all(item.index.index == 0 for plan, _ in results for item in plan.items)


def test_ranks_describing_one_tensor_differently_are_refused_by_name():
    plans = []
    for rank, shape in ((0, (3,)), (1, (4,))):
        planner = StandardPlanner()
        planner.configure_planner({"w": torch.zeros(shape)}, rank=rank, remove_redundancy=False)
        plans.append(planner.build_local_plan())
    with pytest.raises(ValueError, match="'w'"):
        planner.build_global_plan(plans)


def test_get_data_gives_a_detached_host_tensor_and_a_value_as_it_is():
    weight = torch.nn.Parameter(torch.full((2,), 3.0))
    planner = StandardPlanner()
    planner.configure_planner({"w": weight, "cfg": {"lr": 0.1}}, rank=0)
    items = {i.index.fqn: i for i in planner.build_local_plan().items}
    data = planner.get_data(items["w"])
    assert not data.requires_grad and torch.equal(data, weight.detach())
    assert planner.get_data(items["cfg.lr"]) == 0.1


def test_a_load_plan_reads_each_overlap_into_a_view_of_the_target():
    target = torch.zeros(4, 4)
    planner = StandardPlanner()
    planner.configure_planner({"w": target}, _saved("w", (4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))]), rank=0)
    items = planner.build_local_plan().items
    assert [(tuple(i.storage_index.offset), tuple(i.dest_offsets), tuple(i.lengths)) for i in items] == [
        ((0, 0), (0, 0), (2, 4)), ((2, 0), (2, 0), (2, 4))]
    for n, item in enumerate(items):
        planner.acquire_tensor(item).fill_(n + 1)  # what a reader does: write into the view
    assert torch.equal(target, torch.tensor([[1.0] * 4] * 2 + [[2.0] * 4] * 2))


def test_a_saved_tensor_that_does_not_cover_the_target_is_corrupt():
    planner = StandardPlanner()
    planner.configure_planner({"w": torch.zeros(4)}, _saved("w", (4,), [((0,), (2,))]), rank=0)
    with pytest.raises(CorruptCheckpointError, match="'w'.*2 of the 4"):
        planner.build_local_plan()


def test_a_missing_key_or_shape_is_refused_unless_partial_loads_are_allowed():
    planner = StandardPlanner()
    planner.configure_planner({"w": torch.zeros(4), "gone": torch.zeros(1)}, _saved("w", (4,), [((0,), (4,))]))
    with pytest.raises(StateDictMismatchError, match="'gone'"):
        planner.build_local_plan()
    planner = StandardPlanner(allow_partial_load=True)
    planner.configure_planner({"w": torch.zeros(4), "gone": torch.zeros(1)}, _saved("w", (4,), [((0,), (4,))]))
    assert [i.dest_index.fqn for i in planner.build_local_plan().items] == ["w"]
    planner.configure_planner({"w": torch.zeros(5)}, _saved("w", (4,), [((0,), (4,))]))
    with pytest.raises(StateDictMismatchError, match=r"'w'.*\(4,\).*\(5,\)"):
        planner.build_local_plan()


class _Unpicklable:
    pass


def test_apply_bytes_rebuilds_plain_values_and_refuses_code_without_allow_pickle():
    nested: dict[str, Any] = {"opt": {"state": None}}
    meta = Metadata(state_dict_metadata={"opt.state": BytesStorageMetadata()})
    planner = StandardPlanner()
    planner.configure_planner(nested, meta)
    (item,) = planner.build_local_plan().items
    assert item.type == LoadItemType.BYTE_IO
    planner.apply_bytes(item, pickle.dumps({"lr": [0.1, 2]}))
    assert nested["opt"]["state"] == {"lr": [0.1, 2]}  # into the nested dict it came from
    with pytest.raises(UnsupportedValueError, match="'opt.state'.*_Unpicklable"):
        planner.apply_bytes(item, pickle.dumps(_Unpicklable()))
    nested["opt"]["state"] = None
    trusting = StandardPlanner(allow_pickle=True)
    trusting.configure_planner(nested, meta)
    trusting.apply_bytes(item, pickle.dumps(_Unpicklable()))
    assert isinstance(nested["opt"]["state"], _Unpicklable)


def test_a_cached_save_keeps_its_plan_and_metadata_and_needs_collectives():
    StandardPlanner.cached_save_result.clear()
    planner = StandardPlanner()
    planner.configure_planner({"w": torch.zeros(1)}, rank=0)
    plan, meta = SavePlan(items=[]), Metadata(state_dict_metadata={})
    planner.cache_result(plan, meta)
    again = StandardPlanner()
    again.configure_planner({"w": torch.ones(1)}, rank=0)  # same keys: the same entry
    cached = again.get_cached()
    assert cached.final_plan is plan and cached.metadata is meta
    local = StandardPlanner()
    local.configure_planner({"w": torch.zeros(1)}, rank=0, use_collectives=False)
    assert not local._enable_plan_caching and local.get_cached() is None
    StandardPlanner.cached_save_result.clear()


def test_host_destinations_are_not_broadcast_without_a_group_that_sends_host_memory():
    planner = StandardPlanner(broadcast_replicated_tensors=True)
    meta = _saved("w", (4,), [((0,), (4,))])
    planner.configure_planner({"w": torch.zeros(4)}, meta, rank=0)
    local = planner.build_local_plan()
    assert [i.broadcastable for i in local.items] == [False]  # no process group here
    assert planner.build_global_plan([local, local]).items[0].source is None
    # the face's patch point decides what counts as host memory
    original = standard_planner._is_on_host
    standard_planner._is_on_host = lambda obj: False
    try:
        device_plan = planner.build_local_plan()
    finally:
        standard_planner._is_on_host = original
    marked = planner.build_global_plan([device_plan, device_plan]).items[0].source
    assert marked.group_ranks == (0, 1) and marked.src_rank in (0, 1)
    assert planner.build_global_plan([LoadPlan(items=[])]) == LoadPlan(items=[])  # a world of one: as it is


def _save_and_load_through_the_calls(rank: int, world: int, directory: str) -> dict[str, Any]:
    mesh = DeviceMesh("cpu", list(range(world)))
    full = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    state = {"rep": DTensor.from_local(full * 10, mesh, [Replicate()]),
             "row": DTensor.from_local(full[2 * rank:2 * rank + 2].clone(), mesh, [Shard(0)]),
             "meta": {"step": 5}}
    saver = StandardPlanner()
    saver.configure_planner(state, rank=rank, is_coordinator=rank == 0)
    local = saver.build_local_plan()
    plans: list[Any] = [None] * world
    dist.all_gather_object(plans, local)
    plan, metadata = saver.build_global_plan(plans)
    writer = filesystem_storage.FileSystemWriter(directory)
    writer.configure_writer(is_coordinator=rank == 0, rank=rank)
    results = writer.execute_write(saver.finalize_plan(plan), saver)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, results)
    writer.finalize_checkpoint(metadata, every)
    dist.barrier()

    target = {"rep": DTensor.from_local(torch.zeros(4, 4), mesh, [Replicate()]),
              "row": DTensor.from_local(torch.zeros(2, 4), mesh, [Shard(0)]), "meta": {"step": 0}}
    reader = filesystem_storage.FileSystemReader(directory)
    md = reader.load_metadata()
    loader = StandardPlanner()
    loader.configure_planner(target, md, rank=rank, broadcast_replicated_tensors=True)
    local = loader.build_local_plan()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local.identity())
    gathered[rank] = local
    final = loader.finalize_plan(loader.build_global_plan(gathered))
    reader.configure_reader(md, is_coordinator=rank == 0, rank=rank)
    sources = {i.dest_index.fqn: (None if i.source is None else (i.source.group_ranks, i.source.src_rank))
               for i in final.items}
    with util.broadcast_groups_for_load(final.items) as groups:
        reader.execute_read(final, loader, groups, 0)
    return {"rep": torch.equal(target["rep"].to_local(), full * 10),
            "row": torch.equal(target["row"].to_local(), full[2 * rank:2 * rank + 2]),
            "step": target["meta"]["step"], "sources": sources}


def test_a_save_and_load_driven_through_the_calls_on_two_ranks_broadcast_the_replicated_tensor():
    with tempfile.TemporaryDirectory() as d:
        out = run_ranks(_save_and_load_through_the_calls, 2, os.path.join(d, "ckpt"))
    assert all(o["rep"] and o["row"] and o["step"] == 5 for o in out)
    # the replicated tensor is read by one rank for both (gloo sends host memory); shards are not shared
    assert out[0]["sources"]["rep"] == out[1]["sources"]["rep"] and out[0]["sources"]["rep"][0] == (0, 1)
    assert out[0]["sources"]["row"] is None and out[1]["sources"]["row"] is None
