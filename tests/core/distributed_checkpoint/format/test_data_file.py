"""A data file's ``__index__``: every chunk is found where it was placed, whichever way the
index looks it up (binary search for a few lookups, a table once a load asks for many)."""

from __future__ import annotations

import pytest

from hyper_parallel.core.distributed_checkpoint._src.base.box import Box
from hyper_parallel.core.distributed_checkpoint._src.base.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint._src.format import data_file
from hyper_parallel.core.distributed_checkpoint._src.format.data_file import FileIndex, Item, encode_index, plan_file


def _index() -> tuple[FileIndex, list[Item], list[int], list[int]]:
    items = []
    for k in range(12):  # several keys, several column bands (subs) each, sizes that need 1-3 blocks
        rows = 4 + 3 * k
        for sub in range(1 + k % 3):
            items.append(Item(f"model.layers.{k}.w", sub, Box((0, 8 * sub), (rows, 8)), "float32", rows * 8 * 4))
    layout = plan_file(items, "abc", block_bytes=96)
    crcs = list(range(1000, 1000 + layout.n_crcs))
    raw = encode_index(layout, items, crcs, None, block_bytes=96)
    index = FileIndex(raw[:layout.index_length], "f.safetensors", layout.index_offset)
    return index, items, layout.starts, crcs


def _expected(item: Item, start: int, first: int, crcs: list[int]) -> tuple:
    count = data_file.n_blocks(item.box.sizes, item.nbytes, 96)
    return start, tuple(crcs[first:first + count])


def test_every_chunk_is_found_by_search_and_by_table_alike():
    index, items, starts, crcs = _index()
    layout = plan_file(items, "abc", block_bytes=96)
    want = [_expected(i, s, f, crcs) for i, s, f in zip(items, starts, layout.crc_first, strict=True)]
    assert len(items) > 2 * data_file.TABLE_AFTER
    for item, (start, sums) in zip(items, want, strict=True):  # the first lookups search, the rest use the table
        got = index.find(item.key, item.sub, item.box.sizes, item.nbytes)
        assert (got.start, got.crc32c) == (start, sums), item
    assert index._rows is not None  # the table was built
    assert index.find("model.layers.0.w", 7, (4, 8), 128) is None  # no such sub
    assert index.find("absent", 0, (4, 8), 128) is None
    # a fresh index asked in reverse order gives the same answers
    again, *_ = _index()
    for item, (start, sums) in reversed(list(zip(items, want, strict=True))):
        got = again.find(item.key, item.sub, item.box.sizes, item.nbytes)
        assert (got.start, got.crc32c) == (start, sums), item


def test_a_few_lookups_do_not_build_the_table(monkeypatch):
    index, items, *_ = _index()
    for item in items[:data_file.TABLE_AFTER]:
        assert index.find(item.key, item.sub, item.box.sizes, item.nbytes) is not None
    assert index._rows is None
    monkeypatch.setattr(data_file, "TABLE_AFTER", 0)
    fresh, *_ = _index()
    assert fresh.find("absent", 0, (4, 8), 128) is None and fresh._rows is not None


def test_an_index_entry_pointing_past_the_payloads_is_refused_on_both_paths():
    index, items, *_ = _index()
    index.limit = 0  # as if the index said the payloads lie beyond it
    for item in items[:data_file.TABLE_AFTER + 2]:
        with pytest.raises(CorruptCheckpointError, match="points outside"):
            index.find(item.key, item.sub, item.box.sizes, item.nbytes)


def test_tensor_bytes_of_one_element_whose_size_1_dims_have_other_strides():
    import torch

    w = torch.arange(6.0).reshape(1, 6)
    x = w[:, 3]  # shape (1,), stride (6,): torch calls it contiguous
    assert x.is_contiguous() and x.stride() == (6,)
    assert bytes(data_file.tensor_bytes(x)) == torch.tensor([3.0]).numpy().tobytes()
    assert bytes(data_file.tensor_bytes(w[:1, 5:6])) == torch.tensor([5.0]).numpy().tobytes()
