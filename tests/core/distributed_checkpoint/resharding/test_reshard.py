"""reshard in one process: patterns kept per mesh dim name, one file per rank, bounded chunks, errors.

Sharded source checkpoints are made without a process group: a plain checkpoint is
resharded with ``rules`` that split its tensors (a checkpoint as 8 TP ranks would save it).
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch
from helpers import assert_same, files_holding, make_tensor, payload_start, stored_chunks
from torch.distributed.tensor import Shard

from hyper_parallel.core.distributed_checkpoint import (
    CorruptCheckpointError,
    FileSystemReader,
    Layout,
    TensorLayout,
    load,
    save,
)
from hyper_parallel.core.distributed_checkpoint._src.base.box import first_overlap, uncovered
from hyper_parallel.core.distributed_checkpoint._src.engine.metadata_reader import read_checkpoint_metadata
from hyper_parallel.core.distributed_checkpoint._src.engine.streaming_writer import write_streaming
from hyper_parallel.core.distributed_checkpoint._src.format.chunks import overlapping
from hyper_parallel.core.distributed_checkpoint._src.format.metadata import Metadata  # our document
from hyper_parallel.core.distributed_checkpoint._src.planning.planner import EntrySpec, WriteItem
from hyper_parallel.core.distributed_checkpoint._src.resharding.reshard import Box, reshard

TP8 = Layout((8,), ("tp",))


def transformer(layers: int = 2, dim: int = 12, ffn: int = 30, vocab: int = 50) -> dict[str, torch.Tensor]:
    """A transformer-shaped parameter set with sizes that do not divide by 4 or 8."""
    sd = {"tok_embeddings.weight": make_tensor((vocab, dim), seed=1), "norm.weight": make_tensor((dim,), seed=2),
          "output.weight": make_tensor((vocab, dim), seed=3)}
    for i in range(layers):
        p = f"layers.{i}."
        for j, name in enumerate(["attention.wq", "attention.wk", "attention.wv", "attention.wo"]):
            sd[p + name + ".weight"] = make_tensor((dim, dim), seed=10 * i + j + 10)
        sd[p + "feed_forward.w1.weight"] = make_tensor((ffn, dim), seed=10 * i + 5)
        sd[p + "feed_forward.w2.weight"] = make_tensor((dim, ffn), seed=10 * i + 6)
        sd[p + "feed_forward.w3.weight"] = make_tensor((ffn, dim), seed=10 * i + 7)
        sd[p + "attention_norm.weight"] = make_tensor((dim,), seed=10 * i + 8)
        sd[p + "ffn_norm.weight"] = make_tensor((dim,), seed=10 * i + 9)
    return sd


def tp_rules(mesh: Layout) -> dict[str, TensorLayout]:
    """Column-parallel weights Shard(0), row-parallel Shard(1), norms replicated."""
    col, row, rep = mesh("tp", "None"), mesh("None", "tp"), mesh("None")
    return {"*.wq.weight": col, "*.wk.weight": col, "*.wv.weight": col, "*.w1.weight": col, "*.w3.weight": col,
            "*.wo.weight": row, "*.w2.weight": row, "tok_embeddings.weight": col, "output.weight": col,
            "*norm.weight": rep}


@pytest.fixture
def tp8_checkpoint(tmp_path):
    """A TP=8 checkpoint (as 8 ranks would save it) and the global tensors it holds."""
    sd = transformer()
    save({**sd, "step": 100}, str(tmp_path / "plain"), no_dist=True)
    reshard(str(tmp_path / "plain"), str(tmp_path / "tp8"), dst_mesh=TP8, rules=tp_rules(TP8))
    return str(tmp_path / "tp8"), {**sd, "step": 100}


def _meta(path: str) -> dict:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return json.load(f)


def _edit_meta(path: str, edit) -> None:
    """Rewrite ``.metadata`` after ``edit(Metadata)`` (re-sealed, so only the edit differs)."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        meta = Metadata.from_json(f.read())
    edit(meta)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(meta.to_json())


def test_reshard_keeps_each_tensors_placements_on_the_smaller_mesh(tp8_checkpoint, tmp_path):
    src, expected = tp8_checkpoint
    assert _meta(src)["entries"]["layers.0.attention.wq.weight"]["layout"]["mesh_shape"] == [8]
    meta = reshard(src, str(tmp_path / "tp4"), dst_mesh={"tp": 4})
    assert meta.world_size == 4
    e = meta.entries
    assert e["layers.0.attention.wq.weight"].layout == {"mesh_shape": [4], "mesh_dim_names": ["tp"],
                                                        "placements": ["S(0)"]}
    assert e["layers.1.feed_forward.w2.weight"].layout["placements"] == ["S(1)"]
    assert e["norm.weight"].layout["placements"] == ["R"]
    assert e["step"].value == 100
    assert_same(expected, load(path=str(tmp_path / "tp4")))


def test_each_destination_rank_finds_its_shards_in_its_own_file(tp8_checkpoint, tmp_path):
    src, expected = tp8_checkpoint
    meta = reshard(src, str(tmp_path / "tp4"), dst_mesh={"tp": 4})
    files = sorted(f for f in os.listdir(tmp_path / "tp4") if f.endswith(".safetensors"))
    assert [f.split("-")[1] for f in files] == ["r00000", "r00001", "r00002", "r00003"]
    for key, entry in meta.entries.items():
        if entry.kind == "object":
            continue
        tl = TensorLayout.from_record(entry.layout, ndim=len(entry.shape))
        for rank in range(4):  # everything a rank loads (replicated tensors too) is in its own file
            box = tl.chunk_box(rank, entry.shape)
            refs = overlapping(meta, entry, box, rank)
            assert sum(r.box.intersect(box).numel for r in refs) == box.numel, (key, rank)
            assert all(r.files[0].rank == rank for r in refs), (key, rank)
    # replicated tensors are copies in every file; copy_replicas=False stores them once
    norms = [k for k, e in meta.entries.items() if e.layout and all(p == "R" for p in e.layout["placements"])]
    assert norms and all(len(files_holding(str(tmp_path / "tp4"), k)) == 4 for k in norms)
    reshard(src, str(tmp_path / "tp4-once"), dst_mesh={"tp": 4}, copy_replicas=False)
    assert all(len(files_holding(str(tmp_path / "tp4-once"), k)) == 1 for k in norms)
    assert_same(expected, load(path=str(tmp_path / "tp4-once")))


def test_mesh_dims_are_matched_by_name_new_ones_replicate_missing_ones_warn(tmp_path):
    full = {"w": make_tensor((9, 5), seed=1), "v": make_tensor((5, 7), seed=2)}
    save(full, str(tmp_path / "plain"), no_dist=True)
    dp4 = Layout((4,), ("dp",))
    reshard(str(tmp_path / "plain"), str(tmp_path / "dp4"), dst_mesh=dp4,
            rules={"w": dp4("dp", "None"), "v": dp4("None", "dp")})
    # (4,) -> (2, 2): "dp" keeps splitting the same dims, the new "tp" replicates
    m22 = reshard(str(tmp_path / "dp4"), str(tmp_path / "m22"), dst_mesh={"dp": 2, "tp": 2})
    assert m22.entries["w"].layout["placements"] == ["S(0)", "R"]
    assert m22.entries["v"].layout["placements"] == ["S(1)", "R"]
    assert_same(full, load(path=str(tmp_path / "m22")))
    # and back to (4,), with a Layout
    back = reshard(str(tmp_path / "m22"), str(tmp_path / "back"), dst_mesh=dp4)
    assert back.entries["w"].layout == {"mesh_shape": [4], "mesh_dim_names": ["dp"], "placements": ["S(0)"]}
    assert_same(full, load(path=str(tmp_path / "back")))
    # a mesh without "dp": the split is dropped (stored whole), with a warning naming the keys
    with pytest.warns(UserWarning, match=r"\['dp'\].*'w'"):
        tp = reshard(str(tmp_path / "dp4"), str(tmp_path / "tp"), dst_mesh={"tp": 2})
    assert tp.entries["w"].layout["placements"] == ["R"] and len(stored_chunks(tp, "w")) == 1
    assert_same(full, load(path=str(tmp_path / "tp")))


def test_rules_override_the_kept_pattern(tmp_path):
    full = {"w": make_tensor((9, 6), seed=1)}
    save(full, str(tmp_path / "plain"), no_dist=True)
    reshard(str(tmp_path / "plain"), str(tmp_path / "a"), dst_mesh=TP8, rules={"w": TP8("tp", "None")})
    tp3 = Layout((3,), ("tp",))
    meta = reshard(str(tmp_path / "a"), str(tmp_path / "b"), dst_mesh=tp3, rules={"*": tp3("None", "tp")})
    assert meta.entries["w"].layout["placements"] == ["S(1)"]
    assert sorted(b.sizes for b, _, _ in stored_chunks(meta, "w")) == [(9, 2)] * 3
    assert_same(full, load(path=str(tmp_path / "b")))
    with pytest.raises(ValueError, match=r"'w' \(shape \[9, 6\]\): rule .* does not fit: .*3-d tensor"):
        reshard(str(tmp_path / "a"), str(tmp_path / "c"), dst_mesh=tp3, rules={"w": tp3("None", "None", "tp")})
    with pytest.raises(ValueError, match="'w'.*does not fit: tensor dim 2 is out of range"):
        reshard(str(tmp_path / "a"), str(tmp_path / "c"), dst_mesh=tp3, rules={"w": tp3([Shard(2)])})


def test_unnamed_saved_meshes_match_by_position_or_are_named_by_src_mesh(tp8_checkpoint, tmp_path):
    src, expected = tp8_checkpoint
    def unname(meta):
        for e in meta.entries.values():
            if e.layout is not None:
                e.layout["mesh_dim_names"] = None

    _edit_meta(src, unname)
    meta = reshard(src, str(tmp_path / "a"), dst_mesh={"tp": 4})  # same mesh rank: positional
    assert meta.entries["output.weight"].layout["placements"] == ["S(0)"]
    with pytest.raises(ValueError, match="no mesh dim names.*src_mesh="):
        reshard(src, str(tmp_path / "b"), dst_mesh={"dp": 1, "tp": 4})
    meta = reshard(src, str(tmp_path / "b"), src_mesh={"tp": 8}, dst_mesh={"dp": 1, "tp": 4})
    assert meta.entries["output.weight"].layout["placements"] == ["R", "S(0)"]
    assert_same(expected, load(path=str(tmp_path / "b")))


def test_a_tiny_memory_budget_streams_chunks_in_row_slabs_and_loads_exactly(tmp_path):
    full = {"big": make_tensor((64, 48), seed=1), "wide_row": make_tensor((2, 3000), seed=2)}
    save(full, str(tmp_path / "plain"), no_dist=True)
    budget = 4096  # far below one chunk: each is produced and checksummed slab by slab
    meta = reshard(str(tmp_path / "plain"), str(tmp_path / "r"), dst_mesh={"tp": 2}, max_memory=budget)
    assert [b.sizes for b, _, _ in stored_chunks(meta, "big")] == [(64, 48)]  # chunks are not cut up
    assert len(files_holding(str(tmp_path / "r"), "big")) == 2  # replicated: a copy per rank file
    assert_same(full, load(path=str(tmp_path / "r")))


def test_destination_files_share_source_reads_when_the_checkpoint_outgrows_the_cache(tmp_path):
    """4 destination files need every tensor; the cache holds 28 of 32. Written one after the
    other (first in, first out) they read the source 4 times over; written together, about
    once: a file may run ahead of the others by up to 28 tensors before its reads are lost."""

    class Counting(FileSystemReader):
        payload = 0

        def read_into(self, name, offset, buffer):
            Counting.payload += memoryview(buffer).nbytes if offset > 4096 else 0
            return super().read_into(name, offset, buffer)

    full = {f"t{i}": make_tensor((64, 64), seed=i) for i in range(32)}  # 16 KiB each
    save(full, str(tmp_path / "plain"), no_dist=True)
    split = TensorLayout(Layout((4,), ("dp",)), {0: [0]}, 2)
    reshard(None, str(tmp_path / "r"), dst_mesh={"dp": 4}, rules={"t*": split}, max_memory=896 << 10,
            storage_reader=Counting(str(tmp_path / "plain")))
    assert Counting.payload <= 2 * 32 * 16384, Counting.payload  # one file after the other: 3.9x
    assert_same(full, load(path=str(tmp_path / "r")))


def test_plain_values_bytes_arrays_and_odd_dtypes_carry_over(tmp_path):
    sd = {"values": {"step": 7, "lr": 1e-3, "betas": (0.9, 0.95), "name": "run"}, "blob": b"\x00\xffbytes",
          "array": np.arange(10, dtype=np.int16).reshape(2, 5), "scalar": torch.tensor(3.5),
          "empty": torch.empty(0, 4), "bf16": make_tensor((5, 3), torch.bfloat16, seed=4),
          "f8": make_tensor((5, 3), torch.float8_e4m3fn, seed=5), "c128": torch.randn(3, 2, dtype=torch.complex128),
          "mask": make_tensor((4, 4), torch.bool, seed=6)}
    save(sd, str(tmp_path / "plain"), no_dist=True)
    tp4 = Layout((4,), ("tp",))
    reshard(str(tmp_path / "plain"), str(tmp_path / "a"), dst_mesh=tp4,
            rules={"bf16": tp4("tp", "None"), "f8": tp4("None", "tp"), "c128": tp4("tp", "None")})
    reshard(str(tmp_path / "a"), str(tmp_path / "b"), dst_mesh={"tp": 3})
    assert_same(sd, load(path=str(tmp_path / "b")))


def _checkpoint_missing_a_box(path: str, key: str, full: torch.Tensor, missing: Box) -> None:
    """A checkpoint of ``key`` in 8 column boxes (a table of chunks, as imports write) minus one."""
    cols = full.shape[1]
    boxes = [Box((0, c), (full.shape[0], min(4, cols - c))) for c in range(0, cols, 4)]
    items = [WriteItem(key, b, b.numel * 4) for b in boxes if b != missing]
    write_streaming(path, {key: EntrySpec("tensor", (key,), "float32", tuple(full.shape))}, [items],
                    lambda item: full[item.box.relative_to(Box.full(tuple(full.shape)))])


def test_a_missing_source_chunk_is_an_error_naming_the_key_and_region(tmp_path):
    key, full = "w2", make_tensor((12, 30), seed=6)  # split by columns: 4 each, the last 2
    src = str(tmp_path / "src")
    _checkpoint_missing_a_box(src, key, full, Box((0, 12), (12, 4)))
    dst = str(tmp_path / "tp4")
    with pytest.raises(CorruptCheckpointError, match=rf"'{key}'.*region\(s\) \[0:12, 12:16\]"):
        reshard(src, dst, dst_mesh={"tp": 4})
    assert not os.path.exists(os.path.join(dst, ".metadata"))
    assert not [f for f in os.listdir(dst) if f.endswith(".safetensors")] if os.path.isdir(dst) else True
    # load reports it too, naming the key, the missing region and the target region
    with pytest.raises(CorruptCheckpointError, match=rf"'{key}'.*region\(s\) \[0:12, 12:16\].*\[0:12, 0:30\]"):
        load({key: torch.zeros(12, 30)}, src, no_dist=True)


def test_corrupt_source_bytes_fail_the_reshard(tp8_checkpoint, tmp_path):
    src, _ = tp8_checkpoint
    name = files_holding(src, "output.weight")[0]
    start = payload_start(os.path.join(src, name), "output.weight@0,0")
    with open(os.path.join(src, name), "r+b") as f:
        f.seek(start + 5)
        b = f.read(1)
        f.seek(start + 5)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(CorruptCheckpointError, match="'output.weight'.*checksum"):
        reshard(src, str(tmp_path / "x"), dst_mesh={"tp": 4})


def test_reshard_replaces_an_existing_checkpoint_and_never_its_own_source(tp8_checkpoint, tmp_path):
    src, expected = tp8_checkpoint
    dst = str(tmp_path / "out")
    reshard(src, dst, dst_mesh={"tp": 2})
    first = set(os.listdir(dst))
    reshard(src, dst, dst_mesh={"tp": 4})
    now = set(os.listdir(dst))
    assert not (first - {".metadata"}) & now, "files of the replaced checkpoint must be removed"
    assert_same(expected, load(path=dst))
    with pytest.raises(ValueError, match="is the source checkpoint"):
        reshard(src, src + "/.", dst_mesh={"tp": 4})
    with pytest.raises(ValueError, match="dst_mesh"):
        reshard(src, dst)


def test_reshard_reads_only_overlapping_bytes(tmp_path):
    g = torch.arange(256 * 96, dtype=torch.float32).reshape(256, 96)
    save({"w": g}, str(tmp_path / "plain"), no_dist=True)
    tp4 = Layout((4,), ("tp",))
    reshard(str(tmp_path / "plain"), str(tmp_path / "s0"), dst_mesh=tp4, rules={"w": tp4("tp", "None")})
    ratios = {}
    for verify in (False, True):
        reader = FileSystemReader(str(tmp_path / "s0"))
        dst = str(tmp_path / f"s1-{verify}")
        reshard(None, dst, dst_mesh={"tp": 2}, rules={"w": Layout((2,), ("tp",))("None", "tp")},
                storage_reader=reader, verify=verify)
        index = sum(f.index_length for f in read_checkpoint_metadata(FileSystemReader(str(tmp_path / "s0"))).files)
        ratios[verify] = (reader.bytes_read - index) / g.nbytes  # each file's index is read once
        assert torch.equal(load(path=dst)["w"], g)
    print(f"\nreshard Shard(0) on 4 -> Shard(1) on 2: bytes read / bytes written {ratios}")
    # a source tensor that fits the memory budget is read (and verified) once, whole
    assert ratios[False] <= 1.1 and ratios[True] <= 1.1


def test_box_subtraction_and_coverage():
    box = Box((0, 0), (4, 6))
    pieces = box.subtract(Box((1, 2), (2, 2)))
    assert sum(p.numel for p in pieces) == 24 - 4
    assert all(a.intersect(b) is None for i, a in enumerate(pieces) for b in pieces[i + 1:])
    assert uncovered(box, [Box((0, 0), (4, 3)), Box((0, 3), (2, 3))]) == [Box((2, 3), (2, 3))]
    assert uncovered(box, [Box((0, 0), (9, 9))]) == []
    assert Box((2, 0), (5, 3)).split(6) == [Box((2, 0), (2, 3)), Box((4, 0), (2, 3)), Box((6, 0), (1, 3))]
    assert Box((0, 0), (1, 5)).split(2) == [Box((0, 0), (1, 2)), Box((0, 2), (1, 2)), Box((0, 4), (1, 1))]


def test_box_intersection_is_the_overlap_or_none():
    assert Box((0, 0), (4, 6)).intersect(Box((2, 3), (5, 5))) == Box((2, 3), (2, 3))
    assert Box((0, 0), (4, 6)).intersect(Box((4, 0), (1, 6))) is None  # touching is not overlapping
    assert Box((0, 0), (0, 6)).intersect(Box((0, 0), (4, 6))) is None  # an empty box overlaps nothing
    assert Box((), ()).intersect(Box((), ())) == Box((), ())  # 0-d: the one element


def test_first_overlap_finds_a_pair_or_none():
    cols = [Box((0, 2 * i), (8, 2)) for i in range(1000)]  # column shards: swept along dim 1
    assert first_overlap(cols) is None
    assert first_overlap([*cols, Box((3, 5), (1, 1))]) == (2, 1000)
    assert first_overlap([Box((0, 0), (2, 2)), Box((0, 0), (2, 2))]) == (0, 1)  # equal boxes overlap
    assert first_overlap([Box((0, 0), (0, 2)), Box((0, 0), (2, 2))]) is None  # empty boxes do not
    assert first_overlap([Box((), ()), Box((), ())]) == (0, 1)
    assert first_overlap([Box((0, 0), (2, 2)), Box((1, 2), (2, 2)), Box((2, 0), (2, 2))]) is None

def test_destination_rank_list_names_the_data_files(tp8_checkpoint, tmp_path):
    src, expected = tp8_checkpoint
    dst = str(tmp_path / "ranks")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is dropped: no warning
        reshard(src, dst, dst_mesh=Layout((4,), ("tp",), rank_list=[4, 5, 6, 7]))
    ranks = sorted(f.split("-")[1] for f in os.listdir(dst) if f.endswith(".safetensors"))
    assert ranks == ["r00004", "r00005", "r00006", "r00007"]
    assert_same(expected, load(path=dst))
