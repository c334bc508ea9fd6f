"""TopologyMapper at HyperParallel's path: HyperParallel's constructor and compute_required_shards, on
the same class ours (callables, regex rules) uses, so both callers get what they expect."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from hyper_parallel.core.distributed_checkpoint import TopologyMapper as PackageMapper
from hyper_parallel.core.distributed_checkpoint._src.state.topology_mapper import TopologyMapper as StateMapper
from hyper_parallel.core.distributed_checkpoint.topology_mapper import TopologyMapper


def _md(shape, chunks):
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])


def _chunk(offsets, sizes):
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


def test_one_class_serves_the_seed_path_ours_and_the_package():
    assert TopologyMapper is StateMapper is PackageMapper


def test_the_seed_mapping_is_copied_and_unmapped_names_stay():
    mapping = {"stage1.w": "stage0.w"}
    mapper = TopologyMapper(target_to_checkpoint_fqn=mapping)
    mapping["stage1.w"] = "elsewhere"
    assert mapper.map_fqn("stage1.w") == "stage0.w" and mapper.map_fqn("b") == "b"


@pytest.mark.parametrize("bad", [{"": "x"}, {1: "x"}, {"x": ""}, {"x": 2}])
def test_bad_names_in_the_mapping_are_refused(bad):
    with pytest.raises(ValueError, match="non-empty strings"):
        TopologyMapper(target_to_checkpoint_fqn=bad)


def test_reads_for_a_tp4_to_tp2_reshard_under_a_pp_rename():
    mapper = TopologyMapper({"dst.w": "src.w"})
    md = _md((8, 8), [((0, c), (8, 2)) for c in (0, 2, 4, 6)])
    items = mapper.compute_required_shards("dst.w", md, [_chunk((0, 4), (8, 4))])
    assert all(isinstance(i, ReadItem) and i.type is LoadItemType.TENSOR for i in items)
    assert [(i.dest_index, i.dest_offsets, i.storage_index, i.storage_offsets, i.lengths) for i in items] == [
        (MetadataIndex("dst.w", (0, 4), 0), (0, 0), MetadataIndex("src.w", (0, 4), 2), (0, 0), (8, 2)),
        (MetadataIndex("dst.w", (0, 4), 0), (0, 2), MetadataIndex("src.w", (0, 6), 3), (0, 0), (8, 2)),
    ]
    assert items[1].storage_index.index == 3 and items[0].dest_index.index == 0


def test_our_rule_form_plans_reads_too():
    mapper = TopologyMapper(rules=[(r"^layers\.(\d+)\.", lambda m: f"layers.{int(m[1]) + 4}.")])
    items = mapper.compute_required_shards("layers.0.w", _md((4,), [((0,), (4,))]), [_chunk((1,), (2,))])
    assert [(i.storage_index.fqn, i.storage_offsets, i.lengths) for i in items] == [("layers.4.w", (1,), (2,))]


def test_several_local_chunks_are_indexed_in_order():
    md = _md((8,), [((0,), (8,))])
    items = TopologyMapper().compute_required_shards("w", md, [_chunk((0,), (2,)), _chunk((6,), (2,))])
    assert [(i.dest_index.index, i.storage_offsets) for i in items] == [(0, (0,)), (1, (6,))]


def test_a_chunk_meeting_no_saved_chunk_names_the_chunk_and_both_names():
    with pytest.raises(ValueError, match=r"'dst.w': local chunk 0 \[4:8\] has no intersection.*'src.w'"):
        TopologyMapper({"dst.w": "src.w"}).compute_required_shards("dst.w", _md((8,), [((0,), (4,))]),
                                                                   [_chunk((4,), (4,))])


def test_a_hole_in_two_dims_is_found_even_when_each_dim_alone_looks_covered():
    # Saved: the top-left and bottom-right quarters. Each dim's projection covers [0, 4), yet
    # the other two quarters were never saved.
    md = _md((4, 4), [((0, 0), (2, 2)), ((2, 2), (2, 2))])
    with pytest.raises(ValueError, match="not fully covered.*8 elements"):
        TopologyMapper().compute_required_shards("w", md, [_chunk((0, 0), (4, 4))])


def test_no_local_or_no_saved_chunks_plan_no_reads():
    assert TopologyMapper().compute_required_shards("w", _md((4,), [((0,), (4,))]), []) == []
    assert TopologyMapper().compute_required_shards("w", _md((4,), []), [_chunk((0,), (4,))]) == []


@pytest.mark.parametrize("bad", ["", 3, None])
def test_a_bad_target_name_is_refused(bad):
    with pytest.raises(ValueError, match="non-empty string"):
        TopologyMapper().compute_required_shards(bad, _md((4,), [((0,), (4,))]), [_chunk((0,), (4,))])


def test_a_chunk_of_another_rank_count_is_refused_with_both_boxes():
    with pytest.raises(ValueError, match="has 1 dims, saved chunk 0 .* has 2"):
        TopologyMapper().compute_required_shards("w", _md((4, 4), [((0, 0), (4, 4))]), [_chunk((0,), (4,))])
