"""TorchShardedSafetensorsReader: load and reshard what torch's HuggingFaceStorageWriter(save_distributed=True) wrote.

The shards are written by torch itself (``torch.distributed.checkpoint.save`` with
``HuggingFaceStorageWriter(d, save_distributed=True)``) on 2 real gloo ranks, once per module;
they are loaded onto other layouts on real ranks and in one process. Damaged directories are
copies of that output with a file removed, added or rewritten in torch's exact header format.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers import RecordingReader, bits, local_expected, make_tensor
from multiprocess import run_ranks
from safetensors.torch import save_file

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    FileSystemReader,
    FsspecReader,
    HuggingFaceStorageReader,
    NotACheckpointError,
    StateDictMismatchError,
    TorchShardedSafetensorsReader,
    UnsupportedValueError,
    load,
)
from hyper_parallel.core.distributed_checkpoint._src.format import metadata as md

SHARD0 = "shard-00001-model-00001-of-00001.safetensors"  # rank 0's file, as torch names it
SHARD1 = "shard-00002-model-00001-of-00001.safetensors"


def _full() -> dict[str, torch.Tensor]:
    """The global values torch saves (the same on every rank)."""
    return {
        "w": make_tensor((7, 5), seed=1),  # Shard(0), uneven: rows 0:4 and 4:7
        "col": make_tensor((6, 10), torch.bfloat16, seed=2),  # Shard(1)
        "rep": make_tensor((5, 3), torch.float16, seed=3),  # Replicate: one rank writes it
        "one": make_tensor((1, 3), seed=4),  # Shard(0) of one row: rank 1's shard is empty
        "plain": make_tensor((4,), torch.int64, seed=5),  # a plain tensor (replicated)
        "scalar": torch.tensor(1.5),
    }


def _torch_save(rank: int, ws: int, d: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    full = _full()
    placements = {"w": Shard(0), "col": Shard(1), "rep": Replicate(), "one": Shard(0)}
    sd = {k: distribute_tensor(v, mesh, [placements[k]]) if k in placements else v for k, v in full.items()}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(d, save_distributed=True))


@pytest.fixture(scope="module")
def torch_shards(tmp_path_factory):
    """A directory of shards written by torch's own writer on 2 gloo ranks."""
    d = str(tmp_path_factory.mktemp("torch_hf") / "sharded")
    run_ranks(_torch_save, 2, d, timeout_s=180)
    assert sorted(os.listdir(d)) == [SHARD0, SHARD1]  # no index, no .metadata
    return d


@pytest.fixture
def shards(torch_shards, tmp_path):
    """A private copy of the torch shards (tests may damage it)."""
    d = str(tmp_path / "sharded")
    shutil.copytree(torch_shards, d)
    return d


def _torch_header(tensors: dict[str, torch.Tensor], offsets: dict[str, list[int]]) -> dict[str, str]:
    """The ``__metadata__`` torch's writer puts in each shard file (filesystem.py, SAFETENSORS)."""
    return {"DCP_SHARDING_INFO": json.dumps({k: {"saved_offsets": offsets[k]} for k in tensors}),
            "DCP_VERSION": "1.0", "format": "pt"}


def _write_shard(path: str, tensors: dict[str, torch.Tensor], offsets: dict[str, list[int]]) -> None:
    save_file(tensors, path, metadata=_torch_header(tensors, offsets))


# ---------------------------------------------------------------------------- real ranks


def _load_on_ranks(rank: int, ws: int, d: str) -> None:
    from helpers import make_dtensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    full = _full()
    mesh = init_device_mesh("cpu", (ws,))

    def zeros(key, placement, dtype=None):
        return make_dtensor(torch.zeros_like(full[key], dtype=dtype or full[key].dtype), mesh, [placement])

    # every key in another layout than torch saved it; bf16 and fp16 loaded into fp32
    sd = {"w": zeros("w", Shard(1)), "col": zeros("col", Shard(0), torch.float32),
          "rep": zeros("rep", Shard(0), torch.float32), "one": zeros("one", Replicate()),
          "plain": torch.zeros(4, dtype=torch.int64), "scalar": torch.tensor(0.0)}
    load(sd, storage_reader=TorchShardedSafetensorsReader(d))
    for key, v in sd.items():
        want = full[key].to(v.dtype)
        if hasattr(v, "to_local"):
            assert torch.equal(bits(v.to_local()), bits(local_expected(want, v.device_mesh, v.placements))), key
        else:
            assert torch.equal(bits(v), bits(want)), key
    # use_collectives=False: each rank reads the shards' metadata alone
    alone = {"w": zeros("w", Shard(1))}
    load(alone, storage_reader=TorchShardedSafetensorsReader(d), use_collectives=False)
    assert torch.equal(alone["w"].to_local(), local_expected(full["w"], mesh, [Shard(1)]))
    # "w" in torch's own layout: a rank reads data only from its own shard file
    rec = RecordingReader(FileSystemReader(d))
    same = {"w": zeros("w", Shard(0))}
    load(same, storage_reader=TorchShardedSafetensorsReader(d, storage_reader=rec))
    assert torch.equal(same["w"].to_local(), local_expected(full["w"], mesh, [Shard(0)]))
    other = SHARD1 if rank == 0 else SHARD0
    header_end = 8 + int.from_bytes(open(os.path.join(d, other), "rb").read(8), "little")
    assert all(o < header_end for f, o, _ in rec.reads if f == other), rec.reads


def test_torch_shards_reshard_onto_other_layouts_on_two_ranks(torch_shards):
    run_ranks(_load_on_ranks, 2, torch_shards, timeout_s=180)


# ---------------------------------------------------------------------------- one process


def test_one_process_gets_every_tensor_whole(torch_shards):
    out = load(storage_reader=TorchShardedSafetensorsReader(torch_shards, thread_count=4), no_dist=True)
    full = _full()
    assert set(out) == set(full)
    for key, want in full.items():
        assert out[key].dtype == want.dtype and out[key].shape == want.shape, key
        assert torch.equal(bits(out[key]), bits(want)), key


def test_plain_targets_are_filled_in_place_with_dtype_conversion(torch_shards):
    full = _full()
    target = {"w": torch.zeros(7, 5, dtype=torch.float64), "col": torch.zeros(6, 10)}
    load(target, storage_reader=TorchShardedSafetensorsReader(torch_shards), no_dist=True)
    assert torch.equal(target["w"], full["w"].double()) and torch.equal(target["col"], full["col"].float())


def test_metadata_has_one_table_chunk_per_shard_from_the_saved_offsets(torch_shards):
    meta = md.Metadata.from_json(TorchShardedSafetensorsReader(torch_shards).read_metadata_bytes())
    assert [f.name for f in meta.files] == [SHARD0, SHARD1]
    sdm = meta.state_dict_metadata
    chunks = {k: [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks] for k, v in sdm.items()}
    assert chunks["w"] == [((0, 0), (4, 5)), ((4, 0), (3, 5))]
    assert chunks["col"] == [((0, 0), (6, 5)), ((0, 5), (6, 5))]
    assert chunks["one"] == [((0, 0), (1, 3))]  # rank 1's empty shard is no chunk
    assert len(chunks["rep"]) == 1 and tuple(sdm["rep"].size) == (5, 3)
    store = meta.entries["w"].store
    assert [meta.files[i].name for i in store.file] == [SHARD0, SHARD1]
    assert [store.sub(i) for i in range(len(store))] == [0, 0]  # each file holds one shard of a key


def test_fsspec_url_lists_and_reads_the_shards(torch_shards):
    fsspec = pytest.importorskip("fsspec")
    url = f"memory://torch-shards-{os.getpid()}"
    fs = fsspec.filesystem("memory")
    for name in os.listdir(torch_shards):
        fs.put_file(os.path.join(torch_shards, name), f"{url}/{name}")
    try:
        out = load(storage_reader=TorchShardedSafetensorsReader(url), no_dist=True)
        assert torch.equal(out["w"], _full()["w"])
        out = load(storage_reader=TorchShardedSafetensorsReader(url, storage_reader=FsspecReader(url)), no_dist=True)
        assert torch.equal(out["col"], _full()["col"])
    finally:
        fs.rm(url, recursive=True)


def test_import_path_matches_hyper_parallel():
    from hyper_parallel.core.distributed_checkpoint._src.interop.huggingface.reader import (
        TorchShardedSafetensorsReader as R,
    )

    assert R is TorchShardedSafetensorsReader


def test_hugging_face_reader_points_at_this_reader(shards, tmp_path):
    with pytest.raises(NotACheckpointError, match="TorchShardedSafetensorsReader"):
        load(storage_reader=HuggingFaceStorageReader(shards), no_dist=True)
    os.rename(os.path.join(shards, SHARD1), os.path.join(shards, "model.safetensors"))
    with pytest.raises(UnsupportedValueError, match="holds shards of larger tensors.*TorchShardedSafetensorsReader"):
        load(storage_reader=HuggingFaceStorageReader(shards), no_dist=True)


# ---------------------------------------------------------------------------- damaged input


def test_missing_shard_file_is_an_error_naming_key_and_files(shards):
    os.remove(os.path.join(shards, SHARD0))  # rows 0:4 of "w", columns 0:5 of "col"
    with pytest.raises(CorruptCheckpointError) as exc:
        load(storage_reader=TorchShardedSafetensorsReader(shards), no_dist=True)
    msg = str(exc.value)
    assert any(f"tensor '{k}' (shape" in msg for k in ("w", "col", "one")), msg  # each lost its first rows/columns
    assert SHARD1 in msg and "is in no file" in msg, msg
    assert "A shard file is missing" in msg and "no shard-00001-*" in msg, msg


def test_missing_last_shard_file_is_caught_by_the_target_shape(shards):
    # The headers record no full shape: without the file of the last rows, "w" looks like
    # rows 0:4 of a 4x5 tensor. A target of the true shape says so; no data is read.
    os.remove(os.path.join(shards, SHARD1))
    with pytest.raises(StateDictMismatchError, match=r"'w': the checkpoint holds tensor float32 shape \[4, 5\]"):
        load({"w": torch.zeros(7, 5)}, storage_reader=TorchShardedSafetensorsReader(shards), no_dist=True)


def test_overlapping_shards_are_an_error_naming_key_and_both_files(shards):
    # a file left over from an earlier save with another layout: rows 2:5 of "w"
    stale = "shard-00003-model-00001-of-00001.safetensors"
    _write_shard(os.path.join(shards, stale), {"w": torch.zeros(3, 5)}, {"w": [2, 0]})
    with pytest.raises(CorruptCheckpointError,
                       match=rf"tensor 'w': its shard \[0:4, 0:5\] in .*{SHARD0} overlaps its shard \[2:5, 0:5\] "
                             rf"in .*{stale}; the directory mixes shards of different saves"):
        load(storage_reader=TorchShardedSafetensorsReader(shards), no_dist=True)


def _two_scalars(d):
    _write_shard(os.path.join(d, SHARD0), {"s": torch.tensor(1.0)}, {"s": []})
    _write_shard(os.path.join(d, SHARD1), {"s": torch.tensor(2.0)}, {"s": []})


def _dtype_differs(d):
    _write_shard(os.path.join(d, SHARD0), {"w": torch.zeros(2, 3)}, {"w": [0, 0]})
    _write_shard(os.path.join(d, SHARD1), {"w": torch.zeros(2, 3, dtype=torch.bfloat16)}, {"w": [2, 0]})


def _offsets_not_json(d):
    save_file({"w": torch.zeros(2)}, os.path.join(d, SHARD0), metadata={"DCP_SHARDING_INFO": "{oops"})


def _offsets_missing(d):
    save_file({"w": torch.zeros(2), "b": torch.zeros(2)}, os.path.join(d, SHARD0),
              metadata={"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [0]}})})


def _offsets_wrong_ndim(d):
    _write_shard(os.path.join(d, SHARD0), {"w": torch.zeros(2, 2)}, {"w": [0]})


def _negative_offset(d):
    _write_shard(os.path.join(d, SHARD0), {"w": torch.zeros(2)}, {"w": [-2]})


def _stray_hugging_face_file(d):
    _write_shard(os.path.join(d, SHARD0), {"w": torch.zeros(2)}, {"w": [0]})
    save_file({"w": torch.zeros(2)}, os.path.join(d, "consolidated.safetensors"), metadata={"format": "pt"})


def _index_present(d):
    _write_shard(os.path.join(d, SHARD0), {"w": torch.zeros(2)}, {"w": [0]})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"w": SHARD0}}, f)


def _damaged_header(d):
    with open(os.path.join(d, SHARD0), "wb") as f:
        f.write((1 << 40).to_bytes(8, "little") + b"{}")


@pytest.mark.parametrize("make,error,match", [
    (_two_scalars, CorruptCheckpointError, rf"tensor 's': its shard \[\] in .*{SHARD0} overlaps its shard \[\] in"),
    (_dtype_differs, CorruptCheckpointError, rf"tensor 'w' is bfloat16 with 2 dims in .*{SHARD1}, but float32"),
    (_offsets_not_json, CorruptCheckpointError, rf"{SHARD0}: DCP_SHARDING_INFO in its header is not a JSON object"),
    (_offsets_missing, CorruptCheckpointError, r"gives tensor 'b' \(shape \[2\]\) no valid saved_offsets"),
    (_offsets_wrong_ndim, CorruptCheckpointError, r"gives tensor 'w' \(shape \[2, 2\]\) no valid saved_offsets"),
    (_negative_offset, CorruptCheckpointError, r"gives tensor 'w' \(shape \[2\]\) no valid saved_offsets"),
    (_stray_hugging_face_file, UnsupportedValueError, r"consolidated\.safetensors records no DCP_SHARDING_INFO"),
    (_index_present, UnsupportedValueError, r"index\.json: a directory with an index .* HuggingFaceStorageReader"),
    (_damaged_header, CorruptCheckpointError, rf"{SHARD0}: its header claims \d+ bytes"),
    (lambda d: None, NotACheckpointError, r"holds no \*\.safetensors file"),
])
def test_damaged_input_is_a_clear_error(tmp_path, make, error, match):
    make(str(tmp_path))
    with pytest.raises(error, match=match) as exc:
        load({"w": torch.zeros(2)}, storage_reader=TorchShardedSafetensorsReader(tmp_path), no_dist=True)
    assert isinstance(exc.value, CheckpointError)


def test_no_such_directory(tmp_path):
    with pytest.raises(NotACheckpointError, match="no such directory"):
        load(storage_reader=TorchShardedSafetensorsReader(tmp_path / "nope"), no_dist=True)
