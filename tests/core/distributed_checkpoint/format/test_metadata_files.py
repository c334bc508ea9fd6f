"""``.metadata``'s file list checked column by column (65,536 ranks: 65,536 records), with the
same refusals, each named, as the record by record checks; and the one-shard grid fast path."""

from __future__ import annotations

import pytest

from hyper_parallel.core.distributed_checkpoint._src.base.errors import MetadataError
from hyper_parallel.core.distributed_checkpoint._src.format import metadata as md
from hyper_parallel.core.distributed_checkpoint._src.sharding import grid as grid_mod


def _records(n: int) -> list[list]:
    return [[f"data-r{r:05d}-0-0123456789abcdef.safetensors", r % 2, r, 4096 + r, 96, r * 7919 % (1 << 32),
             8192 + r] for r in range(n)]


def test_many_records_parse_as_one_by_one():
    raw = _records(5000)
    fast = md._parse_files(raw, ["", "step_00000001"], "m")
    assert fast == [md._parse_file(f, ["", "step_00000001"], "m") for f in raw]
    assert fast[4999] == md.FileRecord(raw[4999][0], "step_00000001", 4999, 4096 + 4999, 96, raw[4999][5], 8192 + 4999)


@pytest.mark.parametrize("field, value, message", [
    (0, "../x", "not a plain file name"), (1, 2, "dir index"), (2, -2, "rank"), (2, True, "rank"),
    (3, 10 ** 9, "index offset"), (4, 9000, "index length"), (5, 1 << 32, "index crc32c"), (6, 1 << 70, "size"),
    (6, 1.5, "size"), (None, None, "7 fields"),
])
def test_one_bad_record_among_thousands_is_refused_and_named(field, value, message):
    raw = _records(3000)
    if field is None:
        raw[2500] = raw[2500][:6]
    else:
        raw[2500][field] = value
    with pytest.raises(MetadataError, match=message):
        md._parse_files(raw, ["", "step_00000001"], "m")


def test_a_file_listed_twice_is_refused():
    raw = _records(10)
    with pytest.raises(MetadataError, match="twice"):
        md._parse_files(raw + raw[3:4], ["", "step_00000001"], "m")


@pytest.mark.parametrize("length", [0, 1, 5, 37, 65536, 65541])
@pytest.mark.parametrize("parts", [1, 3, 8, 4096, 65536])
def test_one_plain_shard_gives_the_general_paths_intervals(length, parts):
    fast = grid_mod.dim_intervals(length, ((grid_mod._S, parts, 1),))
    general = grid_mod.dim_intervals(length, ((grid_mod._S, parts, 1), (grid_mod._S, 1, 1)))  # same split, long way
    assert fast == general and len(fast) == parts
