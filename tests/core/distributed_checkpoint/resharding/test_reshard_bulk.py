"""The bulk writer of reshard (many ranks of tiny chunks): the same files as the general path.

Each case reshards one source twice, once through :class:`BulkWriter` and once through the
general per-rank path (``bulk_groups`` switched off), and compares every destination file
byte for byte (the save ids, random per reshard, set equal), then loads the bulk result.
"""

from __future__ import annotations

import os

import crc32c
import numpy as np
import pytest
import torch

from hyper_parallel.core.distributed_checkpoint import Layout, load, offline_transform, save
from hyper_parallel.core.distributed_checkpoint._src.base.box import Box
from hyper_parallel.core.distributed_checkpoint._src.format.data_file import Item, plan_file, plan_template
from hyper_parallel.core.distributed_checkpoint._src.format.row_checksums import row_crc32c
from hyper_parallel.core.distributed_checkpoint._src.resharding import reshard as reshard_mod
from hyper_parallel.core.distributed_checkpoint._src.resharding.bulk_write import bulk_groups


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    # keys of one layout out of name order: a file holds chunks in name order, a group in its own
    sd: dict = {f"layers.{i}.w": torch.randn(37, 6, generator=g).to(torch.bfloat16) for i in (3, 0, 2, 1)}
    sd.update({"layers.0.{b}": torch.randn(13, generator=g), "scale": torch.tensor(3.5),
               "ids": torch.arange(11, dtype=torch.int8), "empty": torch.zeros(0, 3), "step": 7})
    return sd


def _files(path: str, save_id: str) -> dict[str, bytes]:
    return {n.replace(save_id, "S"): open(os.path.join(path, n), "rb").read().replace(save_id.encode(), b"S" * 16)
            for n in sorted(os.listdir(path)) if n != ".metadata"}


def _both(tmp_path, monkeypatch, run):
    bulk = run(str(tmp_path / "bulk"))
    with monkeypatch.context() as m:
        m.setattr(reshard_mod, "bulk_groups", lambda plan: None)
        general = run(str(tmp_path / "general"))
    return bulk, general


@pytest.mark.parametrize("case", ["dp8", "dp4xtp2", "dp3xtp2-once", "strategy-uneven"])
def test_bulk_files_equal_the_general_paths_and_load_exactly(tmp_path, monkeypatch, case):
    sd = _state()
    save(sd, str(tmp_path / "src"), no_dist=True)
    src = str(tmp_path / "src")

    def run(dst: str):
        if case == "dp8":
            return reshard_mod.reshard(src, dst, dst_mesh={"dp": 8})
        if case == "dp4xtp2":
            return reshard_mod.reshard(src, dst, dst_mesh={"dp": 4, "tp": 2})
        if case == "dp3xtp2-once":
            return reshard_mod.reshard(src, dst, dst_mesh={"dp": 3, "tp": 2}, copy_replicas=False)
        mesh = Layout((5, 2), ("dp", "tp"))  # rows 37 and 13 over 5: uneven boxes, several file plans
        return offline_transform(src, dst, dst_layout={"*.w": mesh("dp", "tp"), "*b}": mesh("dp"), "ids": mesh("tp")})

    assert bulk_groups(reshard_mod.plan_reshard(_meta(src), {"dp": 8})) is not None  # the bulk path runs
    bulk, general = _both(tmp_path, monkeypatch, run)
    a, b = _files(str(tmp_path / "bulk"), bulk.save_id), _files(str(tmp_path / "general"), general.save_id)
    assert list(a) == list(b) and len(a) > 1
    for name in a:
        assert a[name] == b[name], name
    assert [(f.rank, f.index_offset, f.index_length, f.index_crc, f.size) for f in bulk.files] == \
        [(f.rank, f.index_offset, f.index_length, f.index_crc, f.size) for f in general.files]
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    load(target, str(tmp_path / "bulk"), no_dist=True)
    for k, v in sd.items():
        assert torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v, k


def _meta(path: str):
    from hyper_parallel.core.distributed_checkpoint._src.backends.resolve import reader_for
    from hyper_parallel.core.distributed_checkpoint._src.engine.metadata_reader import read_checkpoint_metadata

    return read_checkpoint_metadata(reader_for(path))


def test_chunks_of_64_kib_or_more_take_the_general_path(tmp_path):
    save({"big": torch.zeros(256, 128), "small": torch.zeros(8, 4)}, str(tmp_path / "src"), no_dist=True)
    meta = _meta(str(tmp_path / "src"))
    assert bulk_groups(reshard_mod.plan_reshard(meta, {"dp": 4})) is None  # kept whole: 128 KiB boxes
    rows = {"*": Layout((4,), ("dp",))("dp", "None")}
    groups = bulk_groups(reshard_mod.plan_reshard(meta, {"dp": 4}, rules=rows))  # 32 KiB boxes
    assert groups is not None and sorted(len(g.keys) for g in groups) == [1, 1]  # two shapes: two groups


@pytest.mark.parametrize("width", [0, 1, 2, 7, 8, 31, 64, 65, 200])
def test_row_checksums_equal_crc32c_of_each_row(width):
    rows = np.random.default_rng(width).integers(0, 256, (40, width), dtype=np.uint8)
    want = np.array([crc32c.crc32c(r.tobytes()) for r in rows], dtype=np.uint32)
    assert (row_crc32c(rows) == want).all()
    assert (row_crc32c(rows[:, ::-1]) == [crc32c.crc32c(r[::-1].tobytes()) for r in rows]).all()  # any strides
    with pytest.raises(ValueError, match="2-d uint8"):
        row_crc32c(rows.astype(np.int16))


def test_a_filled_template_is_the_planned_file():
    items = [Item("a{x}", 0, Box((4, 0), (2, 3)), "bfloat16", 12), Item("b", 0, Box((9,), (5,)), "int8", 5),
             Item("c", 0, Box((4, 0), (2, 3)), "float32", 24)]
    t = plan_template(items, [0, 1, 0], "0123456789abcdef")
    layout = t.layout(t.text.format("4,0", "9"))
    want = plan_file(items, "0123456789abcdef")
    assert (layout.header, layout.starts, layout.crc_first, layout.index_offset, layout.size) == \
        (want.header, want.starts, want.crc_first, want.index_offset, want.size)
    with pytest.raises(ValueError, match="one chunk per key"):
        plan_template(items + items[:1], [0, 1, 0, 0], "0123456789abcdef")
