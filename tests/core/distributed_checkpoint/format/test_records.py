"""The records exported at the ``metadata`` and ``planner`` paths (format/records.py,
planning/records.py) take the records torch's own functions build as instances.

Each is a subclass of torch's record; ``isinstance`` against ours must also hold for torch's
record (what torch's ``create_default_global_save_plan`` or ``create_default_local_save_plan``
returns), or code reached through our import path takes a tensor record for a bytes one. Our
own subclasses of these classes stay strict, and code that needs our fields converts a torch
record (``is_own_record``).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint import metadata as tmd
from torch.distributed.checkpoint import planner as tplanner
from torch.distributed.checkpoint.default_planner import (
    create_default_global_save_plan,
    create_default_local_load_plan,
    create_default_local_save_plan,
)

from hyper_parallel.core.distributed_checkpoint import metadata as md
from hyper_parallel.core.distributed_checkpoint import planner as pl
from hyper_parallel.core.distributed_checkpoint._src.format.records import is_own_record
from hyper_parallel.core.distributed_checkpoint._src.format.torch_view import TorchView
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardPlanner


@pytest.fixture
def torch_built():
    """torch's own plans and metadata for a tensor and a non-tensor value."""
    sd = {"w": torch.rand(4, 2), "step": [1, 2]}
    local = create_default_local_save_plan(sd, True)
    plans, meta = create_default_global_save_plan([local])
    return sd, plans[0], meta


def test_torch_built_metadata_records_are_instances_of_ours(torch_built):
    _, _, meta = torch_built
    assert type(meta) is tmd.Metadata and isinstance(meta, md.Metadata)
    w, step = meta.state_dict_metadata["w"], meta.state_dict_metadata["step"]
    assert type(w) is tmd.TensorStorageMetadata and isinstance(w, md.TensorStorageMetadata)
    assert isinstance(w.properties, md.TensorProperties)
    assert isinstance(step, md.BytesStorageMetadata) and not isinstance(step, md.TensorStorageMetadata)
    assert all(isinstance(i, md.MetadataIndex) for i in meta.storage_data or {})


def test_torch_built_plan_records_are_instances_of_ours(torch_built):
    sd, plan, meta = torch_built
    assert type(plan) is tplanner.SavePlan and isinstance(plan, pl.SavePlan)
    by_key = {i.index.fqn: i for i in plan.items}
    assert isinstance(by_key["w"], pl.WriteItem) and isinstance(by_key["w"].tensor_data, pl.TensorWriteData)
    assert isinstance(by_key["w"].type, pl.WriteItemType) and by_key["w"].type == pl.WriteItemType.TENSOR
    assert isinstance(by_key["step"].type, pl.WriteItemType) and by_key["step"].type == pl.WriteItemType.BYTE_IO
    load = create_default_local_load_plan(sd, meta)
    assert isinstance(load, pl.LoadPlan) and all(isinstance(i, pl.ReadItem) for i in load.items)
    assert {i.type for i in load.items} == {pl.LoadItemType.TENSOR, pl.LoadItemType.BYTE_IO}
    assert all(isinstance(i.type, pl.LoadItemType) for i in load.items)


def test_other_values_are_not_instances():
    assert not isinstance(tmd.BytesStorageMetadata(), md.TensorStorageMetadata)
    assert not isinstance(tplanner.WriteItemType.TENSOR, pl.LoadItemType)  # same member name, other enum
    assert not isinstance("tensor", pl.WriteItemType)
    assert not isinstance(object(), pl.ReadItem)


def test_our_subclasses_stay_strict():
    """TorchView extends our Metadata: a torch record is not one (it lacks the document)."""
    assert not isinstance(tmd.Metadata(state_dict_metadata={}), TorchView)

    class Mine(md.TensorStorageMetadata):
        pass

    ts = tmd.TensorStorageMetadata(tmd.TensorProperties(dtype=torch.float32), torch.Size([2]), [])
    assert not isinstance(ts, Mine)
    assert isinstance(Mine(tmd.TensorProperties(), torch.Size([2])), md.TensorStorageMetadata)


def test_is_own_record_tells_torch_records_from_ours():
    ts = tmd.TensorStorageMetadata(tmd.TensorProperties(dtype=torch.float32), torch.Size([2]), [])
    assert not is_own_record(ts, md.TensorStorageMetadata)
    assert is_own_record(md.TensorStorageMetadata(md.TensorProperties(), torch.Size([2])), md.TensorStorageMetadata)


def test_enum_members_of_both_sides_stay_equal_and_hash_alike():
    assert tplanner.WriteItemType.SHARD == pl.WriteItemType.SHARD
    assert pl.WriteItemType.SHARD == tplanner.WriteItemType.SHARD
    assert tplanner.WriteItemType.SHARD != pl.WriteItemType.TENSOR
    assert {pl.LoadItemType.BYTE_IO: 1}[tplanner.LoadItemType.BYTE_IO] == 1


def test_a_write_item_of_torch_geometry_reads_as_both_forms(torch_built):
    """Given torch's TensorWriteData (an instance of ours by isinstance), a WriteItem still
    converts it to ours, which also reads as HyperParallel's dict."""
    _, plan, _ = torch_built
    torch_item = next(i for i in plan.items if i.index.fqn == "w")
    item = pl.WriteItem(index=torch_item.index, type=torch_item.type, tensor_data=torch_item.tensor_data)
    assert type(item.tensor_data) is pl.TensorWriteData
    assert item.tensor_data["size"] == torch.Size([4, 2]) and item.tensor_storage_size() == 4 * 2 * 4


def test_load_plan_identity_makes_our_read_items_of_torch_ones(torch_built):
    sd, _, meta = torch_built
    torch_plan = create_default_local_load_plan(sd, meta)
    ident = pl.LoadPlan(items=list(torch_plan.items)).identity()
    assert all(type(i) is pl.ReadItem and i.source is None and i.broadcastable for i in ident.items)
    assert [i.dest_index for i in ident.items] == [i.dest_index for i in torch_plan.items]


def test_a_torch_built_tensor_record_plans_a_tensor_read(torch_built):
    """HyperParallel's load planner, given torch's metadata, reads the tensor as a tensor
    (it took every torch-built TensorStorageMetadata for a bytes record before)."""
    sd, _, meta = torch_built
    planner = StandardPlanner()
    planner.configure_planner({"w": torch.zeros(4, 2), "step": None}, meta, rank=0)
    types = {i.dest_index.fqn: i.type for i in planner.build_local_plan().items}
    assert types == {"w": pl.LoadItemType.TENSOR, "step": pl.LoadItemType.BYTE_IO}
