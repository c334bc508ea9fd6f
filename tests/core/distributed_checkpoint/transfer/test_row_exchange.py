"""transfer/row_exchange: which tensors are regrouped into whole rows, and who owns which rows.

The regrouping itself runs on real gloo ranks in test_hf_storage_writer.py (Shard(1), uneven
columns, 2-D meshes, 2 and 4 ranks, bit-exact; a rank failing mid-exchange fails every rank)."""

from __future__ import annotations

from hyper_parallel.core.distributed_checkpoint._src.base.box import Box
from hyper_parallel.core.distributed_checkpoint._src.transfer.row_exchange import owned_rows, regroupable


def test_owned_rows_cover_every_row_once_even_when_ranks_outnumber_rows():
    for rows, world in [(7, 2), (3, 4), (0, 3), (1024, 8)]:
        got = [owned_rows(rows, world, q) for q in range(world)]
        assert got[0][0] == 0 and got[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(got, got[1:], strict=False)), got


def test_only_column_split_tensors_whose_boxes_tile_them_exactly_are_regrouped():
    shapes = {"col": (6, 10), "row": (6, 10), "vec": (10,), "gap": (6, 10), "twice": (6, 10), "grid": (4, 4)}
    rank0 = {"col": [Box((0, 0), (6, 5))], "row": [Box((0, 0), (3, 10))], "vec": [Box((0,), (5,))],
             "gap": [Box((0, 0), (6, 4))], "twice": [Box((0, 0), (6, 5)), Box((0, 0), (6, 5))],
             "grid": [Box((0, 0), (2, 2)), Box((2, 2), (2, 2))]}
    rank1 = {"col": [Box((0, 5), (6, 5))], "row": [Box((3, 0), (3, 10))], "vec": [Box((5,), (5,))],
             "gap": [Box((0, 5), (6, 5))], "grid": [Box((0, 2), (2, 2)), Box((2, 0), (2, 2))]}
    # col: Shard(1); row: Shard(0) (whole rows already); vec: 1-D; gap: a column no box holds;
    # twice: the same half twice (right total, a hole); grid: 2x2 blocks on two ranks
    assert regroupable(shapes, [rank0, rank1]) == ["col", "grid"]
