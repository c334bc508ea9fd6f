"""HuggingFaceStorageReader: load and reshard straight from Hugging Face safetensors directories.

Files are written with ``safetensors.torch.save_file`` (one file, or shards plus
``model.safetensors.index.json`` as ``transformers`` writes them); damaged ones are crafted
byte by byte. The multi-rank cases run on real gloo processes.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from helpers import RecordingReader, assert_same, bits, local_expected, make_tensor
from multiprocess import run_ranks
from safetensors.torch import save_file

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    FileSystemReader,
    HuggingFaceStorageReader,
    MetadataError,
    NotACheckpointError,
    StateDictMismatchError,
    UnsupportedValueError,
    load,
)
from hyper_parallel.core.distributed_checkpoint._src.format import metadata as md

# every dtype safetensors' torch binding reads
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.complex64]


def write_hf(d: str, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` + index (as transformers)."""
    os.makedirs(d, exist_ok=True)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        return dict(shards[0])
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(d, name), metadata={"format": "pt"})
        for k, v in shard.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return {k: v for shard in shards for k, v in shard.items()}


def write_raw(path: str, header: dict, data: bytes) -> None:
    """A safetensors file with exactly this header and data (for damaged files)."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


# ---------------------------------------------------------------------------- one process


def test_single_file_every_dtype_loads_bit_exact(tmp_path):
    sd = {f"t.{str(dt)[6:]}": make_tensor((5, 3), dt, seed=i) for i, dt in enumerate(DTYPES)}
    sd["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    sd["empty"] = torch.empty(0, 4)
    sd["vector"] = make_tensor((11,), torch.int64, seed=99)
    write_hf(str(tmp_path), [sd])
    out = load(storage_reader=HuggingFaceStorageReader(tmp_path), no_dist=True)
    assert_same(out, sd)


def test_float8_e8m0_is_read(tmp_path):
    # safetensors names it F8_E8M0; its torch binding cannot read it, this reader can
    write_raw(str(tmp_path / "model.safetensors"), {"s": {"dtype": "F8_E8M0", "shape": [4],
                                                          "data_offsets": [0, 4]}}, bytes([127, 128, 126, 0]))
    out = load(storage_reader=HuggingFaceStorageReader(tmp_path), no_dist=True)
    assert out["s"].dtype == torch.float8_e8m0fnu
    assert out["s"].view(torch.uint8).tolist() == [127, 128, 126, 0]


def test_sharded_index_fills_target_in_place_and_ignores_stray_files(tmp_path):
    full = write_hf(str(tmp_path), [{"embed.weight": make_tensor((10, 4), seed=1)},
                                    {"layers.0.w": make_tensor((4, 4), torch.bfloat16, seed=2),
                                     "layers.0.b": make_tensor((4,), seed=3)}])
    # a stray file of another name must never be read: it is not even a safetensors file
    (tmp_path / "consolidated.safetensors").write_bytes(b"\xff" * 100)
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    ret = load(target, storage_reader=HuggingFaceStorageReader(tmp_path), no_dist=True)
    assert ret is target
    assert_same(target, full)


def test_target_of_another_dtype_is_converted(tmp_path):
    full = write_hf(str(tmp_path), [{"w": make_tensor((6, 5), torch.bfloat16, seed=4)}])
    target = {"w": torch.zeros(6, 5, dtype=torch.float32)}
    load(target, storage_reader=HuggingFaceStorageReader(tmp_path), no_dist=True)
    assert torch.equal(target["w"], full["w"].float())


def test_missing_key_is_an_error_naming_it_unless_strict_false(tmp_path):
    full = write_hf(str(tmp_path), [{"a": make_tensor((3,), seed=5)}])
    target = {"a": torch.zeros(3), "lm_head.weight": torch.zeros(2, 2)}
    with pytest.raises(StateDictMismatchError, match="lm_head.weight"):
        load(target, storage_reader=HuggingFaceStorageReader(tmp_path), no_dist=True)
    with pytest.warns(UserWarning, match="lm_head.weight"):
        load(target, storage_reader=HuggingFaceStorageReader(tmp_path), no_dist=True, strict=False)
    assert torch.equal(target["a"], full["a"])


def test_shape_mismatch_names_key_and_both_shapes(tmp_path):
    write_hf(str(tmp_path), [{"a": make_tensor((3, 2), seed=6)}])
    with pytest.raises(StateDictMismatchError, match=r"'a'.*shape \[3, 2\]"):
        load({"a": torch.zeros(2, 3)}, storage_reader=HuggingFaceStorageReader(tmp_path), no_dist=True)


def test_hub_cache_symlinks_are_followed(tmp_path):
    # huggingface_hub keeps snapshots/<rev>/model.safetensors -> ../../blobs/<sha>
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    write_hf(str(blobs), [{"w": make_tensor((4, 3), seed=7)}])
    snap.mkdir(parents=True)
    os.rename(blobs / "model.safetensors", blobs / "0123abcd")
    os.symlink("../../blobs/0123abcd", snap / "model.safetensors")
    out = load(storage_reader=HuggingFaceStorageReader(snap), no_dist=True)
    assert torch.equal(out["w"], make_tensor((4, 3), seed=7))


def test_only_the_asked_for_tensor_is_read(tmp_path):
    # one process, a plain target can only be whole; the multi-rank test shards. Here: the
    # header is read twice (metadata, index), the data once, nothing else.
    full = write_hf(str(tmp_path), [{"w": make_tensor((64, 32), seed=8), "b": make_tensor((32,), seed=9)}])
    rec = RecordingReader(FileSystemReader(tmp_path))
    target = {"w": torch.zeros(64, 32)}
    load(target, storage_reader=HuggingFaceStorageReader(tmp_path, storage_reader=rec), no_dist=True)
    assert torch.equal(target["w"], full["w"])
    data = [r for r in rec.reads if r[2] == 64 * 32 * 4]
    assert len(data) == 1 and sum(n for _, _, n in rec.reads) < 64 * 32 * 4 + 2 * 4096  # b never read


def test_reader_reused_after_files_are_rewritten_reads_new_offsets(tmp_path):
    write_hf(str(tmp_path), [{"a": make_tensor((4, 4), seed=10)}])
    reader = HuggingFaceStorageReader(tmp_path)
    load({"a": torch.zeros(4, 4)}, storage_reader=reader, no_dist=True)
    new = write_hf(str(tmp_path), [{"a": make_tensor((4, 4), seed=11), "0": make_tensor((3,), seed=12)}])
    target = {"a": torch.zeros(4, 4)}
    load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["a"], new["a"])


def test_file_changed_after_metadata_was_read_is_detected(tmp_path):
    write_hf(str(tmp_path), [{"a": make_tensor((4, 4), seed=13)}])
    meta = md.Metadata.from_json(HuggingFaceStorageReader(tmp_path).read_metadata_bytes())
    write_hf(str(tmp_path), [{"a": make_tensor((4, 4), seed=13), "b": make_tensor((2,), seed=14)}])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors changed"):
        HuggingFaceStorageReader(tmp_path).file_index(meta.files[0])


def test_metadata_presents_one_table_chunk_per_tensor(tmp_path):
    write_hf(str(tmp_path), [{"a": make_tensor((4, 2), seed=15)}, {"b": torch.zeros(0, 2)}])
    meta = md.Metadata.from_json(HuggingFaceStorageReader(tmp_path, 4).read_metadata_bytes())  # 4 header threads
    assert [f.name for f in meta.files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    sdm = meta.state_dict_metadata
    assert [tuple(c.sizes) for c in sdm["a"].chunks] == [(4, 2)] and sdm["b"].chunks == []
    assert meta.user == {"source": "huggingface"}


def _upload(local: str, url: str, fs) -> None:
    for name in os.listdir(local):
        fs.put_file(os.path.join(local, name), f"{url}/{name}")


def test_fsspec_url_reads_only_the_indexed_files(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    full = write_hf(str(tmp_path), [{"a": make_tensor((8, 3), seed=16)}, {"b": make_tensor((2,), seed=17)}])
    url = f"memory://hf-{os.getpid()}-{id(tmp_path)}"
    fs = fsspec.filesystem("memory")
    _upload(str(tmp_path), url, fs)
    try:
        out = load(storage_reader=HuggingFaceStorageReader(url), no_dist=True)
        assert_same(out, full)
    finally:
        fs.rm(url, recursive=True)


def test_s3_with_storage_options(tmp_path, s3_bucket):
    from hyper_parallel.core.distributed_checkpoint import FsspecReader

    bucket, opts = s3_bucket
    full = write_hf(str(tmp_path), [{"a": make_tensor((16, 4), torch.bfloat16, seed=18)},
                                    {"b": make_tensor((3,), seed=19)}])
    url = f"s3://{bucket}/hf"
    files = FsspecReader(url, **opts)
    _upload(str(tmp_path), url, files.fs)
    target = {"a": torch.zeros(16, 4), "b": torch.zeros(3)}
    load(target, storage_reader=HuggingFaceStorageReader(url, storage_reader=files), no_dist=True)
    assert torch.equal(target["a"], full["a"].float()) and torch.equal(target["b"], full["b"])


def test_import_path_matches_hyper_parallel():
    from hyper_parallel.core.distributed_checkpoint._src.interop.huggingface.reader import HuggingFaceStorageReader as R

    assert R is HuggingFaceStorageReader


# ---------------------------------------------------------------------------- no index


@pytest.mark.parametrize("names", [
    ["model-00001-of-00001.safetensors"],  # what safetensors' save_file and torch's tests leave
    ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"],
    ["weights.safetensors"],  # not numbered: taken as it is
    ["part-a.safetensors", "part-b.safetensors"],
])
def test_a_directory_without_an_index_loads_when_its_files_are_a_whole_set(tmp_path, names):
    full = {f"t{i}": make_tensor((3, i + 2), seed=i) for i in range(len(names))}
    for i, name in enumerate(names):
        save_file({f"t{i}": full[f"t{i}"]}, str(tmp_path / name))
    (tmp_path / "config.json").write_text("{}")  # other files of the directory are not read
    assert_same(load(storage_reader=HuggingFaceStorageReader(tmp_path), no_dist=True), full)
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    load(target, storage_reader=HuggingFaceStorageReader(tmp_path), no_dist=True)
    assert_same(target, full)


def _shards(d, n, present, stem="model"):
    for i in present:
        name = f"{stem}-{i:05d}-of-{n:05d}.safetensors"
        save_file({f"t{stem}{i}": torch.full((2,), float(i))}, os.path.join(d, name))


@pytest.mark.parametrize("make,match", [
    (lambda d: _shards(d, 3, [1, 3]), r"set of 3 .*but lacks model-00002-of-00003\.safetensors, and no "
                                      r"model\.safetensors\.index\.json"),
    (lambda d: _shards(d, 6, [2]), r"lacks model-00001-of-00006\.safetensors, .*model-00005-of-00006\.safetensors "
                                   r"and 1 more"),
    (lambda d: _shards(d, 2, [1, 2, 3]), r"also holds model-00003-of-00002\.safetensors, beyond its 2 files"),
    (lambda d: (_shards(d, 2, [1, 2]), _shards(d, 3, [1, 2, 3])),
     r"shard files of 2 sets .*model-\*-of-00002.*model-\*-of-00003.* no model\.safetensors\.index\.json"),
    (lambda d: (_shards(d, 2, [1, 2]), _good(d, "model-00002-of-00002.safetensors.tmp-0123abcd")),
     r"no model\.safetensors\.index\.json and holds 'model-00002-of-00002\.safetensors\.tmp-0123abcd'.* under way or "
     r"was killed"),
])
def test_a_directory_without_an_index_is_refused_when_its_shards_are_not_a_whole_set(tmp_path, make, match):
    make(str(tmp_path))
    for call in (lambda: load(storage_reader=HuggingFaceStorageReader(tmp_path), no_dist=True),
                 lambda: HuggingFaceStorageReader(tmp_path).read_metadata()):
        with pytest.raises(NotACheckpointError, match=match):
            call()


# ---------------------------------------------------------------------------- damaged input


def _good(d, name="model.safetensors"):
    save_file({"a": torch.arange(4.0), "b": torch.arange(4.0) + 10}, os.path.join(d, name))


def _truncated(d):
    _good(d)
    p = os.path.join(d, "model.safetensors")
    os.truncate(p, os.path.getsize(p) - 3)


def _header_longer_than_file(d):
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", 1 << 20) + b"{}")


def _overlap(d):
    write_raw(os.path.join(d, "model.safetensors"), {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                                     "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}},
              bytes(24))


def _hole(d):
    write_raw(os.path.join(d, "model.safetensors"), {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                                     "b": {"dtype": "F32", "shape": [4], "data_offsets": [20, 36]}},
              bytes(36))


def _size_lie(d):
    write_raw(os.path.join(d, "model.safetensors"), {"b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}},
              bytes(12))


def _past_end(d):
    write_raw(os.path.join(d, "model.safetensors"), {"b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
              bytes(8))


def _trailing(d):
    write_raw(os.path.join(d, "model.safetensors"), {"b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
              bytes(40))


def _not_json(d):
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", 8) + b"{not js}")


def _duplicate_name(d):
    raw = b'{"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],' \
          b'"data_offsets":[4,8]}}'
    raw += b" " * (-len(raw) % 8)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + bytes(8))


def _unknown_dtype(d):
    write_raw(os.path.join(d, "model.safetensors"), {"b": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}},
              bytes(4))


def _sub_byte(d):
    write_raw(os.path.join(d, "model.safetensors"), {"b": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}},
              bytes(1))


def _index(d, weight_map):
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _missing_shard(d):
    _good(d, "model-00001-of-00002.safetensors")
    _index(d, {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
               "c": "model-00002-of-00002.safetensors"})


def _key_not_in_its_file(d):
    _good(d, "model-00001-of-00001.safetensors")
    _index(d, {"a": "model-00001-of-00001.safetensors", "zz": "model-00001-of-00001.safetensors"})


def _tensor_in_two_files(d):
    _good(d, "x-1.safetensors")
    save_file({"b": torch.zeros(2)}, os.path.join(d, "x-2.safetensors"))
    _index(d, {"a": "x-1.safetensors", "b": "x-2.safetensors"})


def _index_not_json(d):
    _good(d)
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        f.write("{oops")


def _index_escapes_directory(d):
    _good(d)
    _index(d, {"a": "../model.safetensors"})


def _torch_shard(d):
    info = json.dumps({"b": {"saved_offsets": [4]}, "a": {"saved_offsets": [0]}})
    save_file({"a": torch.zeros(4), "b": torch.zeros(4)}, os.path.join(d, "model.safetensors"),
              metadata={"DCP_SHARDING_INFO": info})


@pytest.mark.parametrize("make,error,match", [
    (_truncated, CorruptCheckpointError, r"model\.safetensors is truncated"),
    (_header_longer_than_file, CorruptCheckpointError, r"model\.safetensors is truncated: its header claims"),
    (_overlap, CorruptCheckpointError, r"model\.safetensors: tensor 'b' .* overlaps tensor 'a'"),
    (_hole, CorruptCheckpointError, r"model\.safetensors: data bytes 16\.\.20 before tensor 'b'"),
    (_size_lie, CorruptCheckpointError, r"model\.safetensors: tensor 'b': data_offsets \[0, 12\] span 12 bytes"),
    (_past_end, CorruptCheckpointError, r"model\.safetensors is truncated"),
    (_trailing, CorruptCheckpointError, r"model\.safetensors: 36 bytes after the last tensor"),
    (_not_json, CorruptCheckpointError, r"model\.safetensors: its safetensors header is not valid JSON"),
    (_duplicate_name, CorruptCheckpointError, r"model\.safetensors: .*'b' appears twice"),
    (_unknown_dtype, CorruptCheckpointError, r"model\.safetensors: tensor 'b' has dtype 'F99'"),
    (_sub_byte, UnsupportedValueError, r"tensor 'b' has the sub-byte dtype F4"),
    (_missing_shard, CorruptCheckpointError, r"model-00002-of-00002\.safetensors is missing: .* maps 'c'"),
    (_key_not_in_its_file, CorruptCheckpointError, r"maps tensor 'zz' to model-00001-of-00001\.safetensors, but no"),
    (_tensor_in_two_files, CorruptCheckpointError, r"tensor 'b' is in both .*x-1\.safetensors and .*x-2"),
    (_index_not_json, MetadataError, r"model\.safetensors\.index\.json is not valid JSON"),
    (_index_escapes_directory, MetadataError, r"'\.\./model\.safetensors' is not a plain file name"),
    (_torch_shard, UnsupportedValueError, r"model\.safetensors holds shards .*TorchShardedSafetensorsReader"),
    (lambda d: None, NotACheckpointError, r"neither model\.safetensors\.index\.json nor model\.safetensors"),
])
def test_damaged_input_is_a_clear_error(tmp_path, make, error, match):
    make(str(tmp_path))
    with pytest.raises(error, match=match) as exc:
        load({"b": torch.zeros(4)}, storage_reader=HuggingFaceStorageReader(tmp_path), no_dist=True)
    assert isinstance(exc.value, CheckpointError)


def test_file_truncated_after_its_header_was_read_is_an_error(tmp_path):
    _good(str(tmp_path))
    reader = HuggingFaceStorageReader(tmp_path)
    raw = reader.read_metadata_bytes()
    p = tmp_path / "model.safetensors"
    os.truncate(p, os.path.getsize(p) - 4)
    with pytest.raises(CorruptCheckpointError, match="changed since the load read its header"):
        reader.file_index(md.Metadata.from_json(raw).files[0])


# ---------------------------------------------------------------------------- real ranks


def _files(d: str, ws: int) -> dict[str, torch.Tensor]:
    return {
        "big": make_tensor((64, 256), seed=20),  # Shard(0): each rank reads only its rows
        "col": make_tensor((6, 10), torch.bfloat16, seed=21),  # Shard(1), loaded into float32
        "rep": make_tensor((5, 3), torch.float16, seed=22),
        "plain": make_tensor((7,), torch.int64, seed=23),
        "scalar": torch.tensor(1.25),
        "uneven": make_tensor((7, 5), seed=24),
    }


def _write_rank_files(d: str, ws: int) -> dict[str, torch.Tensor]:
    t = _files(d, ws)
    return write_hf(d, [{"big": t["big"]}, {k: v for k, v in t.items() if k != "big"}])


def _hf_on_ranks(rank: int, ws: int, d: str, broken: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hyper_parallel.core.distributed_checkpoint import RankFailedError

    full = _files(d, ws)
    mesh = init_device_mesh("cpu", (ws,))

    def zeros(key, placements, dtype=None, m=mesh):
        t = torch.zeros_like(full[key], dtype=dtype or full[key].dtype)
        from helpers import make_dtensor

        dt = make_dtensor(t, m, placements)
        return dt

    sd = {"big": zeros("big", [Shard(0)]), "col": zeros("col", [Shard(1)], torch.float32),
          "rep": zeros("rep", [Replicate()]), "plain": torch.zeros(7, dtype=torch.int64),
          "scalar": torch.tensor(0.0), "uneven": zeros("uneven", [Shard(0)])}
    if ws == 4:
        mesh2 = init_device_mesh("cpu", (2, 2))
        sd["grid"] = zeros("uneven", [Shard(0), Shard(1)], m=mesh2)
        sd["hsdp"] = zeros("rep", [Replicate(), Shard(0)], m=mesh2)
    rec = RecordingReader(FileSystemReader(d))
    load({k: v for k, v in sd.items() if k not in ("grid", "hsdp")},
         storage_reader=HuggingFaceStorageReader(d, storage_reader=rec))
    for key, v in sd.items():
        if key in ("grid", "hsdp"):
            continue
        want = full[key].to(v.dtype)
        got = v.to_local() if isinstance(v, DTensor) else v
        exp = local_expected(want, v.device_mesh, v.placements) if isinstance(v, DTensor) else want
        assert torch.equal(bits(got), bits(exp)), key
    if ws == 4:  # 2-d mesh targets, another load with a nested target that names the same keys
        load({"uneven": sd["grid"], "rep": sd["hsdp"]}, storage_reader=HuggingFaceStorageReader(d))
        for key, src in (("grid", "uneven"), ("hsdp", "rep")):
            v = sd[key]
            assert torch.equal(v.to_local(), local_expected(full[src], v.device_mesh, v.placements)), key
    # Reads of "big"'s file outside its header: exactly this rank's rows, nothing else.
    big_file = "model-00001-of-00002.safetensors"
    header_end = 8 + int.from_bytes(open(os.path.join(d, big_file), "rb").read(8), "little")
    data_reads = [(o, n) for f, o, n in rec.reads if f == big_file and o >= header_end]
    rows = sd["big"].to_local().shape[0]
    row0 = (64 + ws - 1) // ws * rank
    row_bytes = 256 * 4
    assert sum(n for _, n in data_reads) == rows * row_bytes, data_reads
    assert all(header_end + row0 * row_bytes <= o and o + n <= header_end + (row0 + rows) * row_bytes
               for o, n in data_reads), data_reads
    # use_collectives=False (HyperParallel's dcp_hf_load variant): each rank reads the files alone.
    alone = {"big": zeros("big", [Shard(0)]), "col": zeros("col", [Shard(1)], torch.float32)}
    load(alone, storage_reader=HuggingFaceStorageReader(d), use_collectives=False)
    for key, v in alone.items():
        assert torch.equal(bits(v.to_local()), bits(local_expected(full[key].to(v.dtype), mesh, v.placements))), key
    # No target: every rank gets every tensor whole.
    everything = load(storage_reader=HuggingFaceStorageReader(d))
    assert set(everything) == set(full) and all(torch.equal(bits(everything[k]), bits(full[k])) for k in full)
    # A shard the index names is missing: every rank fails with the same error, nobody hangs.
    try:
        load({"big": torch.zeros(64, 256)}, storage_reader=HuggingFaceStorageReader(broken))
        failed = ""
    except RankFailedError as exc:
        failed = str(exc)
    return {"failed": failed}


@pytest.mark.parametrize("ws", [2, 4])
def test_load_and_reshard_on_real_ranks(tmp_path, ws):
    d, broken = str(tmp_path / "hf"), str(tmp_path / "broken")
    _write_rank_files(d, ws)
    os.makedirs(broken)
    _missing_shard(broken)
    results = run_ranks(_hf_on_ranks, ws, d, broken, timeout_s=180)
    for r in results:
        assert "model-00002-of-00002.safetensors is missing" in r["failed"], r


def test_transformers_save_pretrained_loads_into_a_fresh_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    torch.manual_seed(1)
    fresh = transformers.LlamaForCausalLM(config)
    sd = fresh.state_dict()
    load(sd, storage_reader=HuggingFaceStorageReader(tmp_path), no_dist=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k
