"""Tiny destination shards stored as chunks of several ranks (``min_chunk_bytes``).

The rule (which layouts merge, how many ranks a chunk), then real rewrites: fewer files,
every destination rank's shard loaded exactly (by 4 gloo ranks, and as one rank of 32),
one tensor read from the merged files only, both writers (bulk and general) alike, and the
result verified and rewritten again.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from helpers import make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hyper_parallel.core.distributed_checkpoint import (
    FileSystemReader,
    Layout,
    load,
    offline_transform,
    save,
    verify_checkpoint,
)
from hyper_parallel.core.distributed_checkpoint._src.resharding import reshard as reshard_mod
from hyper_parallel.core.distributed_checkpoint._src.resharding.merged_boxes import merged_layout, ranks_per_chunk


def test_how_many_ranks_a_chunk_merges():
    dp = Layout((32,), ("dp",))
    rows = dp("dp", "None")
    # 256 x 8 float32 over 32 ranks: 8 rows of 32 bytes = 256 bytes a rank
    assert ranks_per_chunk(rows, (256, 8), 4, None) == 1  # off by default
    assert ranks_per_chunk(rows, (256, 8), 4, 256) == 1  # shards already large enough
    assert ranks_per_chunk(rows, (256, 8), 4, 1000) == 4  # the smallest power of two reaching it
    assert ranks_per_chunk(rows, (256, 8), 4, 1 << 30) == 32  # at most the whole mesh
    assert ranks_per_chunk(dp("None", "dp"), (8, 256), 4, 1000) == 4  # a split of dim 1
    # 100 rows over 32 ranks: boxes of 4 rows (the last ones empty); 8 ranks = 32 rows, but 100
    # rows over 4 merged boxes are 25 each: no union of ranks' boxes; 2 ranks (8 of 16 boxes of 7) neither
    assert ranks_per_chunk(rows, (100, 8), 4, 1000) == 1
    assert ranks_per_chunk(rows, (128, 8), 4, 1000) == 8  # 4-row boxes: 8 of them make 1 KiB
    mesh2 = Layout((4, 8), ("dp", "tp"))
    assert ranks_per_chunk(mesh2("dp", "tp"), (256, 8), 4, 1 << 20) == 1  # 2-d meshes keep a chunk per rank
    assert ranks_per_chunk(dp("None", "None"), (256, 8), 4, 1 << 20) == 1  # replicated: nothing to merge
    merged = merged_layout(rows, 4)
    assert merged.layout.mesh_shape == (8,) and list(merged.layout.rank_list) == list(range(0, 32, 4))
    # each merged box is the union of 4 consecutive ranks' boxes
    for b in range(8):
        first, last = rows.chunk_box(4 * b, (256, 8)), rows.chunk_box(4 * b + 3, (256, 8))
        box = merged.chunk_box(4 * b, (256, 8))
        assert box.offsets == first.offsets and box.offsets[0] + box.sizes[0] == last.offsets[0] + last.sizes[0]


def _state() -> dict:
    sd = {f"layers.{i}.w": make_tensor((256, 8), seed=i) for i in range(4)}
    sd["emb"] = make_tensor((64, 4), seed=9).to(torch.bfloat16)
    return sd


def _data_files(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))


class _Reads(FileSystemReader):
    """The files a load reads from."""

    def __init__(self, path):
        super().__init__(path)
        self.names = set()

    def read_into(self, name, offset, buffer):
        self.names.add(name)
        return super().read_into(name, offset, buffer)


@pytest.mark.parametrize("bulk", [True, False])
def test_a_rewrite_for_32_ranks_with_merged_chunks_has_fewer_files_and_loads_exactly(tmp_path, monkeypatch, bulk):
    sd = _state()
    save(sd, str(tmp_path / "src"), no_dist=True)
    dst = str(tmp_path / "dst")
    dp = Layout((32,), ("dp",))
    if not bulk:
        monkeypatch.setattr(reshard_mod, "bulk_groups", lambda plan: None)
    meta = offline_transform(str(tmp_path / "src"), dst, dst_layout={"*": dp("dp", "None")}, min_chunk_bytes=1024)
    # w: 256 bytes a rank, 4 ranks a chunk; emb: 2 rows of 8 bytes a rank, 32 ranks (the whole tensor) a chunk
    assert len(_data_files(dst)) == 8 and sorted(f.rank for f in meta.files) == list(range(0, 32, 4))
    for key, entry in meta.entries.items():  # the entry keeps the destination layout, the store its merged one
        assert entry.layout["mesh_shape"] == [32], key
    assert meta.entries["layers.0.w"].store.layout["rank_list"] == list(range(0, 32, 4))
    assert meta.entries["emb"].store.layout["mesh_shape"] == [1]
    assert verify_checkpoint(dst).ok
    # one tensor, read from the 8 files (each holding its chunks), exactly
    reader = _Reads(dst)
    one = {"layers.2.w": torch.zeros(256, 8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(one, storage_reader=reader, strict=False)
    assert torch.equal(one["layers.2.w"], sd["layers.2.w"]) and len(reader.names) == 8
    whole = {k: torch.zeros_like(v) for k, v in sd.items()}
    load(whole, dst, no_dist=True)
    assert all(torch.equal(whole[k], v) for k, v in sd.items())
    # and it rewrites again, to a chunk per rank of another mesh
    offline_transform(dst, str(tmp_path / "dp4"), dst_layout={"dp": 4})
    again = {k: torch.zeros_like(v) for k, v in sd.items()}
    load(again, str(tmp_path / "dp4"), no_dist=True)
    assert all(torch.equal(again[k], v) for k, v in sd.items()) and len(_data_files(str(tmp_path / "dp4"))) == 4


def test_bulk_and_general_writers_write_the_same_merged_files(tmp_path, monkeypatch):
    save(_state(), str(tmp_path / "src"), no_dist=True)
    dp = Layout((32,), ("dp",))

    def run(dst: str):
        return offline_transform(str(tmp_path / "src"), dst, dst_layout={"*": dp("dp", "None")}, min_chunk_bytes=512)

    bulk = run(str(tmp_path / "bulk"))
    with monkeypatch.context() as m:
        m.setattr(reshard_mod, "bulk_groups", lambda plan: None)
        general = run(str(tmp_path / "general"))

    def files(path: str, save_id: str) -> dict[str, bytes]:
        return {n.replace(save_id, "S"): open(os.path.join(path, n), "rb").read().replace(save_id.encode(), b"S" * 16)
                for n in _data_files(path)}

    a, b = files(str(tmp_path / "bulk"), bulk.save_id), files(str(tmp_path / "general"), general.save_id)
    assert list(a) == list(b) and len(a) == 16
    assert all(a[n] == b[n] for n in a)


def rank_loads_its_shards(rank: int, ws: int, path: str, expected: dict) -> int:
    mesh = init_device_mesh("cpu", (ws,))
    target = {k: make_dtensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in expected.items()}
    load(target, path)
    for k, v in expected.items():
        assert torch.equal(target[k].to_local(), make_dtensor(v, mesh, [Shard(0)]).to_local()), k
    return len(target)


def test_four_gloo_ranks_load_their_shards_from_merged_chunks(tmp_path):
    sd = {f"w{i}": make_tensor((64, 4), seed=i) for i in range(3)}  # 16 rows of 16 bytes a rank
    save(sd, str(tmp_path / "src"), no_dist=True)
    dst = str(tmp_path / "dst")
    offline_transform(str(tmp_path / "src"), dst, dst_layout={"*": Layout((4,), ("dp",))("dp", "None")},
                      min_chunk_bytes=512)
    assert len(_data_files(dst)) == 2  # ranks 0 and 2 hold the chunks of ranks 0-1 and 2-3
    assert run_ranks(rank_loads_its_shards, 4, dst, sd, timeout_s=120) == [3, 3, 3, 3]


def test_min_chunk_bytes_is_checked(tmp_path):
    save({"w": torch.zeros(8, 2)}, str(tmp_path / "src"), no_dist=True)
    for bad in (0, -1, 1.5, "64K"):
        with pytest.raises(ValueError, match="min_chunk_bytes"):
            offline_transform(str(tmp_path / "src"), str(tmp_path / "dst"), dst_layout={"dp": 2},
                              min_chunk_bytes=bad)
