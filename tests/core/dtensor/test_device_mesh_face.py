"""HyperParallel's DeviceMesh additions: ``rank_list``, ``_DEVICE_MESH_MAP``, meshes without groups."""

from __future__ import annotations

import torch
import torch.distributed as dist
from multiprocess import run_ranks

from hyper_parallel import init_device_mesh
from hyper_parallel.core.dtensor import device_mesh
from hyper_parallel.core.dtensor.device_mesh import _DEVICE_MESH_MAP, DeviceMesh, _create_device_mesh


def test_device_mesh_stays_torchs_class():
    assert DeviceMesh is torch.distributed.device_mesh.DeviceMesh


def test_rank_list_is_the_flat_row_major_ranks():
    mesh = DeviceMesh("cpu", [[4, 5], [6, 7]], mesh_dim_names=("dp", "tp"), _init_backend=False, _rank=5)
    assert mesh.rank_list == (4, 5, 6, 7)


def test_mesh_shape_is_the_size_of_each_mesh_dimension():
    mesh = DeviceMesh("cpu", [[4, 5, 6], [7, 8, 9]], mesh_dim_names=("dp", "tp"), _init_backend=False, _rank=5)
    assert mesh.mesh_shape == (2, 3)
    assert all(type(n) is int for n in mesh.mesh_shape)


def test_mesh_without_process_group_has_ranks_and_coordinates():
    _DEVICE_MESH_MAP.clear()
    mesh = _create_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), rank_list=(0, 1, 2, 3),
                               init_backend=False)
    assert mesh.rank_list == (0, 1, 2, 3)
    assert mesh.mesh_dim_names == ("dp", "tp")
    assert tuple(mesh.get_coordinate()) == (0, 0)  # no process group: this process counts as rank 0


def test_meshes_are_cached_by_shape_names_and_ranks():
    _DEVICE_MESH_MAP.clear()
    a = _create_device_mesh("cpu", (2,), mesh_dim_names=("x",), rank_list=(0, 1), init_backend=False)
    b = _create_device_mesh("cpu", (2,), mesh_dim_names=("x",), rank_list=(0, 1), init_backend=False)
    c = _create_device_mesh("cpu", (2,), mesh_dim_names=("x",), rank_list=(2, 3), init_backend=False)
    assert a is b and a is not c and len(_DEVICE_MESH_MAP) == 2
    _DEVICE_MESH_MAP.clear()
    assert _create_device_mesh("cpu", (2,), mesh_dim_names=("x",), rank_list=(0, 1), init_backend=False) is not a


def test_rank_without_process_group_follows_a_patched_get_rank(monkeypatch):
    _DEVICE_MESH_MAP.clear()
    monkeypatch.setattr(device_mesh.dist, "get_rank", lambda *a, **k: 3)
    mesh = _create_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",), init_backend=False)
    _DEVICE_MESH_MAP.clear()
    assert tuple(mesh.get_coordinate()) == (3,)


def _rank_lists(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    _DEVICE_MESH_MAP.clear()
    cached = _create_device_mesh("cpu", (2,), mesh_dim_names=("dp",), rank_list=(0, 1))
    t = torch.ones(1)
    dist.all_reduce(t, group=cached.get_group())
    return {"whole": mesh.rank_list, "tp": mesh["tp"].rank_list, "dp": mesh["dp"].rank_list,
            "cached": cached.rank_list, "sum": t.item(), "shapes": (mesh.mesh_shape, mesh["dp"].mesh_shape)}


def test_rank_list_of_meshes_and_sub_meshes_on_real_ranks():
    for rank, r in enumerate(run_ranks(_rank_lists, 2)):
        assert r["whole"] == (0, 1) and r["tp"] == (0, 1)
        assert r["dp"] == (rank,)  # the dp sub-mesh this rank is in
        assert r["cached"] == (0, 1) and r["sum"] == 2.0
        assert r["shapes"] == ((1, 2), (1,))
