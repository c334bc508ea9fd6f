"""HyperParallel's in-memory reshard helpers at ``distributed_checkpoint.reshard`` (issue 43 item 4):
``ReshardHandler``, ``check_layout`` and the tensor-map geometry, beside our ``reshard()``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import reshard as face
from hyper_parallel.core.distributed_checkpoint._src.sharding.layout import Layout as MeshLayout
from hyper_parallel.core.distributed_checkpoint.reshard import (
    ReshardHandler,
    check_layout,
    infer_slice_area_by_rank,
    rank_id_to_dev_id_list,
)
from hyper_parallel.core.dtensor.layout import Layout


def _layout(mesh_shape, tensor_map, rank_list):
    return SimpleNamespace(mesh_shape=mesh_shape, _tensor_map=tensor_map, _rank_list=rank_list,
                           to_dict=lambda: {"mesh_shape": mesh_shape, "tensor_map": tensor_map,
                                            "rank_list": rank_list})


def _assemble(full, from_layout, to_layout, to_rank):
    """The target slice of ``full`` built from the source slices the handler asks for."""
    h = ReshardHandler("w", full.shape, from_layout, to_layout, to_rank)
    need = h.infer_all_tensor_offset()
    from_dict = from_layout.to_dict() if from_layout is not None else None
    parts = {}
    for rank, rel in need.items():
        pos = from_dict["rank_list"].index(rank) if from_dict else 0
        src = (infer_slice_area_by_rank(from_dict["mesh_shape"], from_dict["tensor_map"], pos, full.shape)
               if from_dict else tuple((0, n) for n in full.shape))
        held = full[tuple(slice(s, e) for s, e in src)]
        parts[rank] = held[tuple(slice(s, e) for s, e in rel)]
    return h, h.get_real_tensor(parts)


def test_the_face_keeps_reshard_and_adds_the_seed_names():
    assert callable(face.reshard) and face.Box is not None
    assert face.infer_intersection(((0, 4),), ((2, 6),)) == ((2, 4),)


def test_dev_ids_are_row_major_and_a_rank_outside_the_mesh_is_refused():
    assert [rank_id_to_dev_id_list((2, 3), r) for r in (0, 4, 5)] == [[0, 0], [1, 1], [1, 2]]
    with pytest.raises(ValueError, match="outside the mesh"):
        rank_id_to_dev_id_list((2, 2), 4)


def test_tensor_map_counts_mesh_dims_from_the_last_and_tuples_go_outermost_first():
    # mesh (dp=2, tp=3): tensor_map 1 is dp, 0 is tp
    assert infer_slice_area_by_rank((2, 3), (1, 0), 5, (4, 6)) == ((2, 4), (4, 6))
    # dim 0 split over (dp, tp): dp outermost; position 4 is dp=1, tp=1 -> piece 1*3+1 = 4 of 6
    assert infer_slice_area_by_rank((2, 3), ((1, 0), -1), 4, (12, 5)) == ((8, 10), (0, 5))


def test_the_area_agrees_with_our_layouts_box_where_the_split_is_even():
    mesh = MeshLayout((2, 2, 3), ("pp", "dp", "tp"))
    tl = mesh("pp", ("tp", "dp"))
    for pos in range(12):
        box = tl.chunk_box(pos, (4, 12))
        assert infer_slice_area_by_rank((2, 2, 3), tl.tensor_map, pos, (4, 12)) == tuple(
            (o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))


def test_an_uneven_split_is_refused_as_in_the_seed():
    with pytest.raises(ValueError, match="cannot be split evenly"):
        infer_slice_area_by_rank((1, 4), (0,), 0, (6,))


def test_check_layout_names_the_missing_attribute_and_checks_sizes():
    check_layout(None, "x")
    with pytest.raises(ValueError, match="_rank_list"):
        check_layout(SimpleNamespace(mesh_shape=(2,), _tensor_map=(0,)), "bad")
    with pytest.raises(ValueError, match=r"rank_list size \(3\) must match device count \(4"):
        check_layout(_layout((2, 2), (0,), [0, 1, 2]), "bad")
    with pytest.raises(TypeError, match="tensor_map must be tuple or list"):
        check_layout(_layout((2,), 0, [0, 1]), "bad")


def test_replicated_to_row_shard_takes_the_rows_from_rank_0():
    full = np.arange(8, dtype=np.float32).reshape(4, 2)
    h, got = _assemble(full, None, _layout((1, 2), (0, -1), [0, 1]), 1)
    assert h.global_union_area_map == {0: ((2, 4), (0, 2))}
    np.testing.assert_array_equal(got, full[2:4])


def test_row_shard_to_column_shard_over_other_ranks_pastes_every_overlap():
    full = np.arange(48, dtype=np.int64).reshape(6, 8)
    src = _layout((1, 3), (0, -1), [10, 11, 12])           # rows over 3 ranks
    dst = _layout((2, 1), (-1, 1), [20, 21])               # columns over 2 ranks
    h, got = _assemble(full, src, dst, 21)
    assert sorted(h.global_union_area_map) == [10, 11, 12]
    np.testing.assert_array_equal(got, full[:, 4:8])


def test_only_one_replica_of_a_source_slice_is_read():
    full = np.arange(16.0).reshape(4, 4)
    src = _layout((2, 2), (0, -1), [0, 1, 2, 3])          # rows over tp (last dim), replicated over dp
    h, got = _assemble(full, src, None, 0)
    assert h.inner_deredundancy_from_rank_list == [0, 1] and sorted(h.global_union_area_map) == [0, 1]
    np.testing.assert_array_equal(got, full)


def test_torch_slices_give_a_torch_tensor():
    full = torch.arange(8.0).reshape(4, 2)
    h = ReshardHandler("w", (4, 2), None, _layout((1, 2), (0, -1), [0, 1]), 0)
    h.infer_all_tensor_offset()
    got = h.get_real_tensor({0: full[0:2]})
    assert isinstance(got, torch.Tensor) and torch.equal(got, full[0:2])


def test_our_layouts_are_accepted():
    full = np.arange(24.0).reshape(4, 6)
    dlay = Layout((2,), ("tp",), init_backend=False)
    dlay.set_placements((Shard(1),))
    dlay.placement_to_tensor_map(dim=2)
    tl = MeshLayout((2,), ("dp",))(Replicate(), ndim=2)
    _, got = _assemble(full, tl, dlay, 1)
    np.testing.assert_array_equal(got, full[:, 3:6])


def test_errors_name_the_parameter_and_the_fix():
    with pytest.raises(ValueError, match="cannot both be None"):
        ReshardHandler("w", (2, 2), None, None, 0)
    with pytest.raises(ValueError, match="to_rank_id 5 is not in"):
        ReshardHandler("w", (4, 2), None, _layout((1, 2), (0, -1), [0, 1]), 5)
    h = ReshardHandler("w", (4, 2), None, _layout((1, 2), (0, -1), [0, 1]), 1)
    h.infer_all_tensor_offset()
    with pytest.raises(ValueError, match="Missing slice data from rank 0"):
        h.get_real_tensor({99: np.zeros((2, 2))})
    with pytest.raises(ValueError, match=r"Expected \(2, 2\), got \(1, 2\)"):
        h.get_real_tensor({0: np.zeros((1, 2))})
    with pytest.raises(ValueError, match="empty"):
        h.get_real_tensor({})
    no_map = Layout((2,), ("tp",), init_backend=False)
    with pytest.raises(ValueError, match="placement_to_tensor_map"):
        check_layout(no_map, "to_layout")
