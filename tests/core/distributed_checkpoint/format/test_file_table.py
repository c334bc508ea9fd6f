"""``.metadata``'s file table (format/file_table.py): rows (v2) checked column by column (65,536 ranks:
65,536 records) with the same refusals, each named, as the record by record checks; columns (v3) for long
tables, round-tripped and refused when forged; and the one-shard grid fast path."""

from __future__ import annotations

import json

import pytest
import torch

from hyper_parallel.core.distributed_checkpoint import Layout, load, offline_transform, save
from hyper_parallel.core.distributed_checkpoint._src.base.errors import MetadataError
from hyper_parallel.core.distributed_checkpoint._src.format import file_table as ft
from hyper_parallel.core.distributed_checkpoint._src.format import metadata as md
from hyper_parallel.core.distributed_checkpoint._src.format.sealed_json import seal_json
from hyper_parallel.core.distributed_checkpoint._src.sharding import grid as grid_mod

DIRS = ["", "step_00000001"]


def _records(n: int) -> list[list]:
    return [[f"data-r{r:05d}-0-0123456789abcdef.safetensors", r % 2, r, 4096 + r, 96, r * 7919 % (1 << 32),
             8192 + r] for r in range(n)]


def test_many_records_parse_as_one_by_one():
    raw = _records(5000)
    fast = ft.parse_rows(raw, DIRS, "m")
    assert fast == [ft._parse_row(f, DIRS, "m") for f in raw]
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
        ft.parse_rows(raw, DIRS, "m")


def test_a_file_listed_twice_is_refused():
    raw = _records(10)
    with pytest.raises(MetadataError, match="twice"):
        ft.parse_rows(raw + raw[3:4], DIRS, "m")


def _mixed(n: int) -> list[ft.FileRecord]:
    """Our writers' names under two save ids and two thread indices, in two directories, and names no
    rule gives (an import's, a v1-style rank -1 file)."""
    out = [ft.FileRecord(ft.data_file_name(r, r % 2, "ab12" if r % 3 else "ffee0099"), DIRS[r % 2], r,
                         1000 + r, 24 + r % 7, (r * 2654435761) % (1 << 32), 5000 + 3 * r) for r in range(n)]
    out[5] = ft.FileRecord("model-00001-of-00002.safetensors", "", 5, 10, 20, 7, 100)
    out[6] = ft.FileRecord("data-r00006-0-ab12.safetensors", "", -1)  # the rule's shape, no rank: named apart
    out[7] = ft.FileRecord("data-r7-0-ab12.safetensors", "", 7, 1, 1, 1, 9)  # rank not zero-padded as the rule pads
    return out


def test_columns_round_trip_every_record():
    files = _mixed(3000)
    cols = ft.encode_columns(files, DIRS)
    assert sorted(cols["names"]) == ["5", "6", "7"]
    assert cols["save_ids"] == ["ffee0099", "ab12"]
    assert ft.parse_columns(json.loads(json.dumps(cols)), DIRS, "m") == files


def test_a_long_table_is_written_as_columns_version_3_and_a_short_one_as_rows_version_2():
    for n, version in [(ft.COLUMNAR_FILES - 1, 2), (ft.COLUMNAR_FILES, 3)]:
        meta = md.Metadata({}, "ab12", n, files=_mixed(n), dirs=list(DIRS))
        doc = json.loads(meta.to_json())
        assert doc["version"] == version and isinstance(doc["files"], dict if version == 3 else list)
        back = md.Metadata.from_json(meta.to_json())
        assert back.version == version and back.files == meta.files


def test_columns_of_65536_ranks_cost_under_half_the_rows():
    files = [ft.FileRecord(ft.data_file_name(r, 0, "0123456789abcdef0123456789abcdef"), "", r, 150_000 + r % 977,
                           24_576, (r * 2654435761) % (1 << 32), 180_000 + r % 977) for r in range(65536)]
    rows = len(json.dumps(ft.encode_rows(files, [""]), separators=(",", ":")))
    cols = len(json.dumps(ft.encode_columns(files, [""]), separators=(",", ":")))
    assert cols < 40 * 65536 < rows / 2, (cols, rows)


def _columns(n: int = 40) -> dict:
    return json.loads(json.dumps(ft.encode_columns(_mixed(n), DIRS)))


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c.__setitem__("files", []), None),  # not an object: the version's form is refused
    (lambda c: c.__setitem__("count", -1), "count"),
    (lambda c: c.__setitem__("count", 41), "column"),
    (lambda c: c["rank"].__setitem__(3, True), "column 'rank'"),
    (lambda c: c.__setitem__("size", {"all": 1.5}), "column 'size'"),
    (lambda c: c.__setitem__("save_ids", ["../x"]), "save_ids"),
    (lambda c: c["save_id"].__setitem__(9, 7), "name no file"),
    (lambda c: c["n"].__setitem__(9, -1), "does not name it"),
    (lambda c: c["names"].__setitem__("9", "x.safetensors"), "not a row whose n is -1"),
    (lambda c: c["names"].__setitem__("5", "../escape"), "not a plain file name"),
    (lambda c: c["rank"].__setitem__(11, 13), "twice"),  # row 11 then names row 13's file
    (lambda c: c["size"].__setitem__(12, 1), "index offset"),
])
def test_a_forged_column_table_is_refused_and_named(mutate, message):
    cols = _columns()
    if message is None:
        with pytest.raises(MetadataError, match="object of columns"):
            ft.parse_columns([], DIRS, "m")
        return
    mutate(cols)
    with pytest.raises(MetadataError, match=message):
        ft.parse_columns(cols, DIRS, "m")


def test_a_forged_count_costs_no_memory():
    cols = {"count": ft.MAX_FILES, "save_ids": ["ab"], "names": {}, **{k: {"all": 0} for k in
            ("n", "save_id", "dir", "rank", "index_offset", "index_length", "index_crc32c", "size")}}
    with pytest.raises(MetadataError, match="same name"):
        ft.parse_columns(cols, DIRS, "m")


def test_each_version_takes_only_its_own_table_form():
    meta = md.Metadata({}, "ab12", 4, files=_mixed(ft.COLUMNAR_FILES), dirs=list(DIRS))
    doc = json.loads(meta.to_json())
    doc.pop("crc32c")
    doc["version"] = 2  # columns under a version 2 document
    with pytest.raises(MetadataError, match="list of file records"):
        md.Metadata.from_json(seal_json(doc))
    doc["version"], doc["files"] = 3, ft.encode_rows(meta.files, DIRS)  # rows under version 3
    with pytest.raises(MetadataError, match="object of columns"):
        md.Metadata.from_json(seal_json(doc))


@pytest.mark.parametrize("length", [0, 1, 5, 37, 65536, 65541])
@pytest.mark.parametrize("parts", [1, 3, 8, 4096, 65536])
def test_one_plain_shard_gives_the_general_paths_intervals(length, parts):
    fast = grid_mod.dim_intervals(length, ((grid_mod._S, parts, 1),))
    general = grid_mod.dim_intervals(length, ((grid_mod._S, parts, 1), (grid_mod._S, 1, 1)))  # same split, long way
    assert fast == general and len(fast) == parts


def test_a_checkpoint_of_1100_ranks_is_written_as_version_3_and_loads_exact(tmp_path):
    ranks = 1100
    full = torch.arange(ranks * 2 * 3, dtype=torch.float32).reshape(ranks * 2, 3)
    save({"w": full, "step": 7}, checkpoint_id=str(tmp_path / "one"))
    offline_transform(str(tmp_path / "one"), str(tmp_path / "many"),
                      dst_layout={"w": Layout((ranks,), ("dp",))("dp", "None")})
    with open(tmp_path / "many" / ".metadata", "rb") as f:
        doc = json.loads(f.read())
    assert doc["version"] == 3 and doc["files"]["count"] == ranks and doc["files"]["names"] == {}
    out = {"w": torch.zeros_like(full), "step": 0}
    load(out, checkpoint_id=str(tmp_path / "many"))
    assert torch.equal(out["w"], full) and out["step"] == 7
