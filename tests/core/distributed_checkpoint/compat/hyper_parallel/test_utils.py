"""HyperParallel's ``distributed_checkpoint.utils`` helpers at their HyperParallel's path (issue 43 item 4),
beside torch's ``utils`` names, which keep working."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import utils
from hyper_parallel.core.distributed_checkpoint._src.base.box import Box
from hyper_parallel.core.distributed_checkpoint._src.state.flatten import flatten, unflatten
from hyper_parallel.core.distributed_checkpoint.metadata import CHUNK_INFO, ChunkInfo


def _mesh(ranks, names, rank):
    return DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=names, _init_backend=False, _rank=rank)


def test_torch_names_stay_and_dist_is_torch_distributed():
    assert utils.find_tensor_shard(torch.ones(2), MetadataIndex("w")).shape == (2,)
    assert utils.dist is torch.distributed


def test_intersection_of_areas_is_the_box_overlap_and_none_when_apart():
    assert utils.infer_intersection(((0, 4), (1, 3)), ((2, 6), (0, 2))) == ((2, 4), (1, 2))
    assert utils.infer_intersection(((0, 2),), ((2, 5),)) is None  # touching is not overlapping


def test_intersection_refuses_areas_of_different_dims_and_malformed_ranges():
    with pytest.raises(ValueError, match="different dims"):
        utils.infer_intersection(((0, 2),), ((0, 2), (0, 2)))
    with pytest.raises(TypeError, match="2-element"):
        utils.infer_intersection(((0, 1, 2),), ((0, 2),))


def test_chunk_to_area_and_narrow_select_the_same_region():
    t = torch.arange(48).reshape(6, 8)
    chunk = ChunkStorageMetadata(offsets=torch.Size([2, 1]), sizes=torch.Size([3, 4]))
    area = utils.chunk_to_area(chunk)
    assert area == ((2, 5), (1, 5))
    view = utils.narrow_tensor_by_index(t, chunk.offsets, chunk.sizes)
    assert torch.equal(view, t[2:5, 1:5]) and view.data_ptr() == t[2, 1].data_ptr()  # a view, no copy
    assert utils.narrow_tensor_by_index(np.arange(10), (3,), (2,)).tolist() == [3, 4]
    assert utils.narrow_tensor_by_index(t, (), ()) is t


def test_flatten_descends_every_mapping_and_keeps_plain_lists_whole():
    w = torch.zeros(2)
    flat, paths = utils.flatten_state_dict({"m": {"w": w, "layers": [{"b": w}], "empty": {}}, "lr": [0.1, 0.2]})
    assert flat == {"m.w": w, "m.layers.0.b": w, "lr": [0.1, 0.2]}
    assert paths["m.layers.0.b"] == ("m", "layers", 0, "b") and paths["lr"] == ("lr",)


def test_flatten_names_the_key_two_paths_share():
    with pytest.raises(ValueError, match=r"Duplicate flattened FQN 'a.b.c'.*\('a', 'b.c'\)"):
        utils.flatten_state_dict({"a": {"b.c": 1}, "a.b": {"c": 2}})


def test_set_element_inverts_flatten_state_dict():
    nested = {"model": {"layers": [{"w": torch.ones(1)}, {"w": torch.zeros(1)}]}, "step": 3}
    flat, paths = utils.flatten_state_dict(nested)
    root: dict = {}
    for key, value in flat.items():
        utils.set_element(root, paths[key], value)
    again, _ = utils.flatten_state_dict(root)
    assert again.keys() == flat.keys() and all(again[k] is flat[k] for k in flat)
    assert isinstance(root["model"]["layers"], list) and root["step"] == 3


def test_set_element_pads_lists_and_refuses_an_empty_path():
    root: dict = {}
    utils.set_element(root, ("xs", 2), "c")
    assert root == {"xs": [None, None, "c"]}
    with pytest.raises(ValueError, match="non-empty path"):
        utils.set_element(root, (), 1)


def test_unflatten_still_rebuilds_our_paths_after_sharing_set_at():
    nested = {"a": [torch.ones(1), (torch.zeros(1), torch.ones(2))], "b": {"c": torch.ones(3)}}
    f = flatten(nested)
    back = unflatten({leaf.path: leaf.value for leaf in f.leaves.values()})
    assert isinstance(back["a"][1], tuple) and back["b"]["c"].shape == (3,)


def test_traverse_visits_tensors_inside_lists():
    seen = []
    utils.traverse_state_dict({"opt": [{"m": torch.ones(1)}, 5]}, lambda p, v: seen.append(p))
    assert seen == [("opt", 0, "m"), ("opt", 1)]


def test_all_gather_object_without_collectives_is_the_local_object():
    assert utils.all_gather_object({"x": 1}, world_size=4, use_collectives=False) == [{"x": 1}]
    assert utils.all_gather_object("a", world_size=1, use_collectives=True) == ["a"]


def test_all_gather_object_with_collectives_calls_torch(monkeypatch):
    def fake(out, obj):
        out[:] = [obj, obj + 1]
    monkeypatch.setattr(utils.dist, "all_gather_object", fake)
    assert utils.all_gather_object(1, world_size=2, use_collectives=True) == [1, 2]


def test_chunk_list_of_a_plain_tensor_and_of_chunk_info():
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in utils.create_chunk_list_for_tensor(torch.zeros(3, 5))] \
        == [((0, 0), (3, 5))]
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 4]), sizes=torch.Size([4, 4]))
    p = torch.nn.Parameter(torch.zeros(4, 4))
    object.__setattr__(p, CHUNK_INFO, ChunkInfo(chunk=chunk, global_shape=(8, 8)))
    assert utils.create_chunk_list_for_tensor(p) == [chunk]


def test_chunk_list_refuses_other_types_and_bad_chunk_info():
    with pytest.raises(ValueError, match="Not support type int"):
        utils.create_chunk_list_for_tensor(42)
    p = torch.nn.Parameter(torch.zeros(2))
    object.__setattr__(p, CHUNK_INFO, "x")
    with pytest.raises(ValueError, match="ChunkInfo"):
        utils.create_chunk_list_for_tensor(p)


def test_chunk_list_of_a_dtensor_is_its_box_and_an_empty_trailing_shard_keeps_its_offset():
    t = DTensor.from_local(torch.empty(4, 2), _mesh([[0, 1], [2, 3]], ("dp", "tp"), 3), [Replicate(), Shard(1)],
                           shape=torch.Size((4, 4)), stride=(4, 1), run_check=False)
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in utils.create_chunk_list_for_tensor(t)] == [((0, 2), (4, 2))]
    empty = DTensor.from_local(torch.empty(0, 3), _mesh([0, 1, 2, 3], ("fsdp",), 3), [Shard(0)],
                               shape=torch.Size((6, 3)), stride=(3, 1), run_check=False)
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in utils.create_chunk_list_for_tensor(empty)] \
        == [((6, 0), (0, 3))]


def test_chunk_list_is_empty_on_a_rank_outside_the_mesh():
    t = DTensor.from_local(torch.empty(0, 3), _mesh([1, 2, 3, 4], ("fsdp",), 0), [Shard(0)],
                           shape=torch.Size((6, 3)), stride=(3, 1), run_check=False)
    assert utils.create_chunk_list_for_tensor(t) == []


def test_chunk_list_of_a_ragged_dtensor_is_the_boxes_of_its_run():
    from hyper_parallel.core.dtensor.placement_types import RaggedShard

    t = DTensor.from_local(torch.arange(48.0), _mesh([0, 1], ("ragged",), 0), (RaggedShard((0, 1), (1, 3)),),
                           shape=torch.Size((6, 4, 8)), stride=(32, 8, 1), run_check=False)
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in utils.create_chunk_list_for_tensor(t)] \
        == [((0, 0, 0), (1, 4, 8)), ((1, 0, 0), (1, 2, 8))]


def _item(key, nbytes):
    return SimpleNamespace(index=MetadataIndex(key), tensor_storage_size=lambda: nbytes)


def test_ownership_keeps_one_copy_of_each_shared_item_and_every_unique_one():
    a, b, c = _item("a", 8), _item("b", 8), _item("c", 4)
    masks = utils.plan_ownership_masks([SimpleNamespace(items=[a, b]), SimpleNamespace(items=[b, c])])
    assert [list(m) for m in masks] in ([[1, 1], [0, 1]], [[1, 0], [1, 1]])
    assert masks[0][0] == 1 and masks[1][1] == 1


def test_ownership_gives_shared_items_largest_first_to_the_least_loaded_holder():
    big, small = _item("big", 100), _item("small", 10)
    plans = [SimpleNamespace(items=[small, big]), SimpleNamespace(items=[small, big])]
    masks = utils.plan_ownership_masks(plans)
    assert list(masks[0]) == [0, 1] and list(masks[1]) == [1, 0]  # big to plan 0, small to the lighter plan 1
    lowest = utils.plan_ownership_masks(plans, save_to_minimum_rank=True)
    assert list(lowest[0]) == [1, 1] and list(lowest[1]) == [0, 0]


def test_ownership_accepts_our_own_write_items():
    item = SimpleNamespace(key="w", box=Box((0,), (4,)), nbytes=16, sub=0)
    twin = SimpleNamespace(key="w", box=Box((0,), (4,)), nbytes=16, sub=0)
    masks = utils.plan_ownership_masks([SimpleNamespace(items=[item]), SimpleNamespace(items=[twin])])
    assert sum(masks[0]) + sum(masks[1]) == 1
