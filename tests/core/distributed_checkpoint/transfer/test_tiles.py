"""Column bands ("tiles"): a column-sharded reader reads and verifies only its bands."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import make_tensor

from hyper_parallel.core.distributed_checkpoint import (
    CorruptCheckpointError,
    FileSystemReader,
    StandardPlanner,
    load,
    save,
)
from hyper_parallel.core.distributed_checkpoint._src.base.box import Box
from hyper_parallel.core.distributed_checkpoint._src.planning.planner import EntrySpec


def _spec(shape, dtype="float32", layout=None):
    return EntrySpec("tensor", ("w",), dtype, tuple(shape), layout)


def test_default_tile_policy():
    p = StandardPlanner()
    assert p.tiles("w", _spec((1024, 2048))) == p.max_tiles > 1
    assert p.tiles("w", _spec((100, 100))) == 1


def test_tile_policy_cuts_large_wide_chunks_into_power_of_two_bands():
    p = StandardPlanner()
    p.max_tiles, p.tile_min_band_bytes = 8, 1024
    assert p.tiles("w", _spec((1024, 2048))) == 8  # 8 MiB chunk, 8 KiB rows
    assert p.tiles("w", _spec((1024, 512))) == 2  # 2 KiB rows: bands of at least 1 KiB
    assert p.tiles("w", _spec((1024, 2048), "bfloat16")) == 4
    assert p.tiles("w", _spec((100, 100))) == 1  # a small chunk stays whole
    assert p.tiles("w", _spec((1 << 20,))) == 1  # 1-d
    assert p.tiles("w", _spec((1 << 16, 3))) == 1  # rows too narrow
    s0 = {"mesh_shape": [4], "placements": ["S(0)"]}
    s1 = {"mesh_shape": [4], "placements": ["S(1)"]}
    assert p.tiles("w", _spec((512, 2048), layout=s0)) == 8  # 4 MiB / 4 ranks: chunks of 1 MiB
    assert p.tiles("w", _spec((256, 2048), layout=s0)) == 1  # chunks of 512 KiB stay whole
    assert p.tiles("w", _spec((4096, 2048), layout=s1)) == 2  # a box has 512 columns (2 KiB)
    p.max_tiles = 1
    assert p.tiles("w", _spec((1024, 2048))) == 1


def test_tile_settings_are_part_of_the_plan_cache_key():
    a, b = StandardPlanner(), StandardPlanner()
    b.max_tiles = 1
    assert a.cache_key() != b.cache_key()


class _Columns(StandardPlanner):
    """Load columns ``lo:hi`` of the saved 'w' into a target holding only them."""

    def __init__(self, lo, hi):
        super().__init__()
        self.lo, self.hi = lo, hi

    def _destination(self, key, entry, target):
        return Box((0, self.lo), (entry.shape[0], self.hi - self.lo)), target

    def _mismatch(self, *a):
        raise AssertionError


def _tiles_of(path, key):
    return json.load(open(os.path.join(path, ".metadata")))["entries"][key]["store"]["grid"]["tiles"]


@pytest.mark.parametrize("verify", [True, False])
def test_a_column_reader_reads_only_its_bands_and_verifies_them(tmp_path, verify):
    full = make_tensor((512, 2048))  # 4 MiB, cut into bands
    path = str(tmp_path / "ckpt")
    save({"w": full}, path, no_dist=True)
    assert _tiles_of(path, "w") > 1
    target = {"w": torch.zeros(512, 1024)}
    reader = FileSystemReader(path)
    load(target, path, storage_reader=reader, planner=_Columns(1024, 2048), verify=verify)
    assert torch.equal(target["w"], full[:, 1024:])
    needed = 512 * 1024 * 4
    assert reader.bytes_read <= 1.1 * needed, reader.bytes_read / needed
    assert reader.read_calls <= 4  # the four bands are adjacent: one run (plus the index)


def test_a_column_reader_between_band_edges_reads_the_bands_it_overlaps(tmp_path):
    full = make_tensor((512, 2048), torch.bfloat16)  # 4 bands of 512 columns
    path = str(tmp_path / "ckpt")
    planner = StandardPlanner()
    planner.max_tiles = 4
    save({"w": full}, path, planner=planner, no_dist=True)
    assert _tiles_of(path, "w") == 4
    target = {"w": torch.zeros(512, 700, dtype=torch.bfloat16)}
    reader = FileSystemReader(path)
    load(target, path, storage_reader=reader, planner=_Columns(300, 1000))
    assert torch.equal(target["w"], full[:, 300:1000])
    assert reader.bytes_read <= 2 * 512 * 512 * 2 + 64 * 1024  # bands 0 and 1 only


def test_same_layout_loads_of_tiled_chunks_are_exact(tmp_path):
    sd = {"a": make_tensor((1000, 2048)), "b": make_tensor((333, 4099), torch.bfloat16),
          "c": make_tensor((2048, 4, 300), torch.float16)}
    path = str(tmp_path / "ckpt")
    save(sd, path, no_dist=True)
    assert all(_tiles_of(path, k) > 1 for k in sd)
    for direct in (None, False):
        out = load(path=path, storage_reader=FileSystemReader(path, direct_io=direct))
        assert all(torch.equal(out[k], v) for k, v in sd.items())
        target = {k: torch.zeros_like(v) for k, v in sd.items()}
        load(target, path, storage_reader=FileSystemReader(path, direct_io=direct))
        assert all(torch.equal(target[k], v) for k, v in sd.items())


def _payload_and_index(path):
    """A checkpoint's data file without its safetensors header (which names the save id)."""
    (name,) = [n for n in os.listdir(path) if n.startswith("data-")]
    raw = open(os.path.join(path, name), "rb").read()
    return raw[8 + int.from_bytes(raw[:8], "little"):]


def test_bands_gathered_in_one_copy_are_written_as_one_by_one(tmp_path, monkeypatch):
    sd = {"gaps": make_tensor((600, 784)),  # bands of 470,400 B: 4 KiB-aligned, padding between
          "dense": make_tensor((64, 256)),  # 2 bands of 32 KiB, packed without padding
          "bf16": make_tensor((3000, 784), torch.bfloat16),
          "three_d": make_tensor((300, 512, 2)),
          "transposed": make_tensor((512, 700)).t(),  # bands of a non-contiguous tensor
          "uneven": make_tensor((1000, 1001))}  # bands of unequal widths: one by one
    planner = StandardPlanner()
    planner.tile_min_chunk_bytes = 64 << 10
    grouped, single = str(tmp_path / "grouped"), str(tmp_path / "single")
    save(sd, grouped, planner=planner, no_dist=True)
    monkeypatch.setattr("hyper_parallel.core.distributed_checkpoint._src.transfer.saver.BAND_GROUP_BYTES", 0)
    save(sd, single, planner=planner, no_dist=True)
    assert all(_tiles_of(grouped, k) > 1 for k in sd)
    assert _payload_and_index(grouped) == _payload_and_index(single)
    out = load(path=grouped)
    assert all(torch.equal(out[k], v) for k, v in sd.items())


def test_a_damaged_band_is_found_by_a_column_reader(tmp_path):
    full = make_tensor((512, 2048))
    path = str(tmp_path / "ckpt")
    save({"w": full}, path, no_dist=True)
    name = [f for f in os.listdir(path) if f.endswith(".safetensors")][0]
    raw = open(os.path.join(path, name), "rb").read()
    n = int.from_bytes(raw[:8], "little")
    entries = json.loads(raw[8:8 + n])
    last = max((k for k in entries if k.startswith("w@")), key=lambda k: int(k.split(",")[1]))
    assert last != "w@0,0"
    lo, _ = entries[last]["data_offsets"]  # the last band
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(8 + n + lo + 12345)
        byte = f.read(1)
        f.seek(8 + n + lo + 12345)
        f.write(bytes([byte[0] ^ 0xFF]))
    target = {"w": torch.zeros(512, 1024)}
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        load(target, path, planner=_Columns(1024, 2048))
    target = {"w": torch.zeros(512, 1024)}
    load(target, path, planner=_Columns(0, 1024))  # the other bands are intact
    assert torch.equal(target["w"], full[:, :1024])


def test_untiled_checkpoints_still_load(tmp_path):
    full = make_tensor((512, 2048))
    path = str(tmp_path / "ckpt")
    planner = StandardPlanner()
    planner.max_tiles = 1
    save({"w": full}, path, planner=planner, no_dist=True)
    assert _tiles_of(path, "w") == 1
    target = {"w": torch.zeros(512, 1024)}
    load(target, path, planner=_Columns(1024, 2048))
    assert torch.equal(target["w"], full[:, 1024:])


def test_read_box_of_part_of_a_tiled_chunk(tmp_path):
    from hyper_parallel.core.distributed_checkpoint._src.engine.metadata_reader import read_checkpoint_metadata
    from hyper_parallel.core.distributed_checkpoint._src.transfer.loader import read_box
    full = make_tensor((512, 2048))
    path = str(tmp_path / "ckpt")
    save({"w": full}, path, no_dist=True)
    reader = FileSystemReader(path)
    meta = read_checkpoint_metadata(reader)
    out, _ = read_box(meta.entries["w"], reader, Box((10, 100), (300, 900)), meta=meta)
    assert torch.equal(out, full[10:310, 100:1000])


def test_tensors_of_one_layout_share_one_grid_and_long_rank_lists_get_their_own():
    from hyper_parallel.core.distributed_checkpoint._src.sharding.grid import Grid, shared_grid

    a = shared_grid((64, 8), (2,), ["S(0)"], None, 4)
    assert shared_grid([64, 8], [2], ("S(0)",), None, 4) is a  # lists and tuples alike
    assert shared_grid((64, 8), (2,), ["S(1)"], None, 4) is not a
    assert a.band_subs(1) == Grid((64, 8), (2,), ["S(0)"], None, 4).band_subs(1)
    ranks = list(range(128))
    assert shared_grid((128, 8), (128,), ["S(0)"], ranks) is not shared_grid((128, 8), (128,), ["S(0)"], ranks)
