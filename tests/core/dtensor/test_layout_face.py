"""hyper_parallel.core.dtensor.layout.Layout: HyperParallel's DTensor layout over our checkpoint Layout."""

from __future__ import annotations

import pytest
import torch
from multiprocess import run_ranks
from torch.distributed.tensor import Replicate, Shard

import hyper_parallel
from hyper_parallel.core.distributed_checkpoint._src.sharding.layout import Layout as CheckpointLayout
from hyper_parallel.core.dtensor.device_mesh import _DEVICE_MESH_MAP, DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor, from_local_with_layout
from hyper_parallel.core.dtensor.layout import Layout


def test_is_our_checkpoint_layout():
    layout = Layout((2, 4), ("dp", "tp"), init_backend=False)
    assert isinstance(layout, CheckpointLayout)
    assert layout("tp", "None").tensor_map == (0, -1)
    assert hyper_parallel.Layout is Layout


def test_mesh_is_built_once_without_process_groups():
    _DEVICE_MESH_MAP.clear()
    layout = Layout((2,), ("ragged",), init_backend=False)
    assert layout.mesh is layout.mesh
    assert layout.mesh.rank_list == (0, 1) and layout.mesh.mesh_dim_names == ("ragged",)
    assert Layout((2,), ("ragged",), init_backend=False).mesh is layout.mesh  # shared via _DEVICE_MESH_MAP


def test_placements_give_the_seed_tensor_map():
    layout = Layout((2, 2), ("dp", "tp"), init_backend=False)
    layout.set_placements((Shard(0), Shard(1)))
    assert layout.placement_to_tensor_map(dim=2) == [1, 0]
    assert layout.tensor_map == (1, 0)
    assert layout.to_dict()["tensor_map"] == [1, 0]
    layout.set_placements((Replicate(), Shard(0)))
    assert layout.placement_to_tensor_map(dim=3) == [0, -1, -1]


def test_placement_errors_say_what_to_do():
    layout = Layout((2,), ("dp",), init_backend=False)
    with pytest.raises(ValueError, match="set_placements"):
        layout.placement_to_tensor_map(dim=1)
    with pytest.raises(ValueError, match="one per mesh dim"):
        layout.set_placements((Shard(0), Shard(1)))
    with pytest.raises(ValueError, match="non-negative"):
        layout.placement_to_tensor_map(dim=-1)


def test_from_device_mesh_keeps_the_mesh():
    mesh = DeviceMesh("cpu", [0, 1, 2, 3], mesh_dim_names=("fsdp",), _init_backend=False, _rank=3)
    layout = Layout.from_device_mesh(mesh)
    assert layout.mesh is mesh and tuple(layout.rank_list) == (0, 1, 2, 3) and layout.alias_name == ("fsdp",)


def test_from_local_with_layout_keeps_the_global_shape_of_an_empty_trailing_shard():
    mesh = DeviceMesh("cpu", [0, 1, 2, 3], mesh_dim_names=("fsdp",), _init_backend=False, _rank=3)
    layout = Layout.from_device_mesh(mesh)
    layout.set_placements((Shard(0),))
    layout.placement_to_tensor_map(dim=2)
    layout.set_tensor_meta((6, 3), (3, 1), torch.float32)
    t = DTensor.from_local_with_layout(torch.empty(0, 3), layout)
    assert isinstance(t, DTensor) and tuple(t.shape) == (6, 3) and tuple(t.to_local().shape) == (0, 3)
    assert DTensor.from_local_with_layout is from_local_with_layout


def _from_local_with_layout(rank: int, world: int) -> list:
    _DEVICE_MESH_MAP.clear()
    layout = Layout((2,), ("dp",))
    layout.set_placements((Shard(0),))
    layout.set_tensor_meta((3, 2), (2, 1), torch.float32)
    local = torch.arange(4.0).reshape(2, 2) if rank == 0 else torch.tensor([[4.0, 5.0]])
    t = DTensor.from_local_with_layout(local, layout)
    return t.full_tensor().tolist()


def test_from_local_with_layout_on_real_ranks_with_uneven_shards():
    for full in run_ranks(_from_local_with_layout, 2):
        assert full == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
