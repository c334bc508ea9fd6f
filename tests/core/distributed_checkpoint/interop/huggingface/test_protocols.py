"""The safetensors-directory readers on HyperParallel's reader calls and torch's (``interop/hf_protocols.py``).

``HuggingFaceStorageReader`` and ``TorchShardedSafetensorsReader`` answer HyperParallel's
``load_metadata`` / ``configure_reader`` / ``execute_read`` and torch's ``read_metadata`` /
``set_up_storage_reader`` / ``read_data``, driven here by planners that speak one set of names
only, by torch's own ``torch.distributed.checkpoint.load``, by the remap planner and by our
own planner, on real files written by ``safetensors.torch.save_file``; the sharded cases run on
2 gloo ranks. The errors that refuse a directory are both ours and the builtin class
HyperParallel's readers raise.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from helpers import make_tensor
from multiprocess import run_ranks
from safetensors.torch import save_file
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    MetadataError,
    NotACheckpointError,
    UnsupportedValueError,
    load,
)
from hyper_parallel.core.distributed_checkpoint._src.format import metadata as md
from hyper_parallel.core.distributed_checkpoint._src.planning.standard_planner import StandardPlanner
from hyper_parallel.core.distributed_checkpoint.hf_storage import (
    DCP_SHARDING_INFO_KEY,
    SAVED_OFFSETS_KEY,
    HuggingFaceStorageReader,
    TorchShardedSafetensorsReader,
)
from hyper_parallel.core.distributed_checkpoint.metadata import (
    CHUNK_INFO,
    ChunkInfo,
    ChunkStorageMetadata,
    MetadataIndex,
)
from hyper_parallel.core.distributed_checkpoint.remap_planner import RemapBlock, RemapLoadPlanner
from hyper_parallel.core.distributed_checkpoint.storage import StorageInfo

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHARD_1 = "shard-00001-model-00001-of-00001.safetensors"
SHARD_2 = "shard-00002-model-00001-of-00001.safetensors"
EYE2 = ((1, 0), (0, 1))


def save(path: Path, tensors: dict[str, torch.Tensor], offsets: dict[str, list[int]] | None = None) -> None:
    """One safetensors file; ``offsets`` recorded as torch's HuggingFaceStorageWriter records a shard's place."""
    meta = None
    if offsets is not None:
        meta = {DCP_SHARDING_INFO_KEY: json.dumps({k: {SAVED_OFFSETS_KEY: v} for k, v in offsets.items()})}
    save_file(tensors, str(path), metadata=meta)


def index(directory: Path, weight_map: dict[str, str]) -> None:
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def raw(path: Path, header: Any, data: bytes = b"") -> None:
    """A safetensors file with exactly this header (for headers safetensors would not write)."""
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def torch_shards(directory: Path) -> torch.Tensor:
    """Rows 0-1 and 2-4 of a 5x4 tensor "w" in two of torch's shard files, "norm" whole in the first."""
    full = make_tensor((5, 4), seed=3)
    save(directory / SHARD_1, {"w": full[:2].clone(), "norm": torch.arange(3.0)}, {"w": [0, 0], "norm": [0]})
    save(directory / SHARD_2, {"w": full[2:].clone()}, {"w": [2, 0]})
    return full


def part(tensor: torch.Tensor, offsets: tuple[int, ...], global_shape: tuple[int, ...]) -> torch.Tensor:
    """Mark ``tensor`` as the part of a global tensor at ``offsets``, as HyperParallel marks a plain shard."""
    setattr(tensor, CHUNK_INFO, ChunkInfo(chunk=ChunkStorageMetadata(offsets=offsets, sizes=tuple(tensor.shape)),
                                          global_shape=global_shape))
    return tensor


class SeedNamesOnly:
    """A planner answering only HyperParallel's hook names (torch's default planner inside), recording them."""

    def __init__(self) -> None:
        self.inner = DefaultLoadPlanner()
        self.calls: list[tuple[str, str, tuple[int, ...]]] = []

    def configure_planner(self, state_dict: dict[str, Any], metadata: Any, **kwargs: Any) -> None:
        self.inner.set_up_planner(state_dict, metadata, True)

    def build_local_plan(self) -> Any:
        return self.inner.create_local_plan()

    def acquire_tensor(self, item: Any) -> torch.Tensor:
        self.calls.append(("acquire", item.storage_index.fqn, tuple(item.storage_index.offset)))
        return self.inner.resolve_tensor(item)

    def apply_tensor(self, item: Any, tensor: torch.Tensor) -> None:
        self.calls.append(("apply", item.storage_index.fqn, tuple(item.storage_index.offset)))
        self.inner.commit_tensor(item, tensor)


def seed_read(reader: Any, planner: Any, state_dict: dict[str, Any], rank: int = 0) -> Any:
    """HyperParallel's read of one rank, call by call; returns the plan it executed."""
    metadata = reader.load_metadata()
    planner.configure_planner(state_dict, metadata, rank=rank)
    plan = planner.build_local_plan()
    reader.configure_reader(metadata, is_coordinator=rank == 0, rank=rank)
    reader.execute_read(plan, planner)
    return plan


# ---------------------------------------------------------------------------- load_metadata


def test_load_metadata_describes_each_tensor_as_hyperparallel_does(tmp_path):
    save(tmp_path / "model.safetensors", {"embed": torch.zeros(4, 3, dtype=torch.bfloat16), "norm": torch.zeros(3),
                                          "step": torch.tensor(5), "empty": torch.zeros(0, 2)})
    meta = HuggingFaceStorageReader(tmp_path).load_metadata()
    described = {k: (tuple(m.size), m.properties.dtype, m.chunks) for k, m in meta.state_dict_metadata.items()}
    assert described == {
        "embed": ((4, 3), "torch.bfloat16", [ChunkStorageMetadata(offsets=(0, 0), sizes=(4, 3))]),
        "norm": ((3,), "torch.float32", [ChunkStorageMetadata(offsets=(0,), sizes=(3,))]),
        "step": ((), "torch.int64", [ChunkStorageMetadata(offsets=(), sizes=())]),
        "empty": ((0, 2), "torch.float32", [ChunkStorageMetadata(offsets=(0, 0), sizes=(0, 2))]),
    }
    assert meta.storage_data[MetadataIndex("embed", offset=(0, 0))] == StorageInfo(
        relative_path="model.safetensors", offset=0, length=-1, tensor_key="embed")
    # no file holds a byte of an empty tensor: it has a chunk, and nothing in storage_data
    assert sorted(i.fqn for i in meta.storage_data) == ["embed", "norm", "step"]
    assert isinstance(meta.document, md.Metadata) and set(meta.document.entries) == set(described)


def test_load_metadata_of_torch_shards_has_a_chunk_and_a_file_per_shard(tmp_path):
    torch_shards(tmp_path)
    meta = TorchShardedSafetensorsReader(tmp_path).load_metadata()
    assert tuple(meta.state_dict_metadata["w"].size) == (5, 4)
    assert meta.state_dict_metadata["w"].chunks == [ChunkStorageMetadata(offsets=(0, 0), sizes=(2, 4)),
                                                    ChunkStorageMetadata(offsets=(2, 0), sizes=(3, 4))]
    assert {(i.fqn, tuple(i.offset)): (s.relative_path, s.tensor_key) for i, s in meta.storage_data.items()} == {
        ("w", (0, 0)): (SHARD_1, "w"), ("w", (2, 0)): (SHARD_2, "w"), ("norm", (0,)): (SHARD_1, "norm")}


def test_load_metadata_reads_the_files_as_they_are_now(tmp_path):
    save(tmp_path / "model.safetensors", {"w": torch.zeros(2)})
    reader = HuggingFaceStorageReader(tmp_path)
    assert tuple(reader.load_metadata().state_dict_metadata["w"].size) == (2,)
    save(tmp_path / "model.safetensors", {"w": torch.arange(5.0)})
    assert tuple(reader.load_metadata().state_dict_metadata["w"].size) == (5,)
    target = {"w": torch.zeros(5)}
    seed_read(reader, SeedNamesOnly(), target)
    assert torch.equal(target["w"], torch.arange(5.0))


# ---------------------------------------------------------------------------- reads


def test_execute_read_calls_hyperparallels_hook_names_across_shard_files(tmp_path):
    full = torch_shards(tmp_path)
    target = {"w": torch.zeros(5, 4, dtype=torch.float64), "norm": torch.zeros(3)}
    planner = SeedNamesOnly()  # it has no resolve_tensor: a call by torch's names would fail
    seed_read(TorchShardedSafetensorsReader(tmp_path), planner, target)
    assert torch.equal(target["w"], full.double()) and torch.equal(target["norm"], torch.arange(3.0))
    assert sorted(planner.calls) == [("acquire", "norm", (0,)), ("acquire", "w", (0, 0)), ("acquire", "w", (2, 0)),
                                     ("apply", "norm", (0,)), ("apply", "w", (0, 0)), ("apply", "w", (2, 0))]
    assert all(planner.calls.index(("acquire", *c[1:])) < i for i, c in enumerate(planner.calls) if c[0] == "apply")


def test_read_data_runs_a_torch_planner_and_returns_a_completed_future(tmp_path):
    tensors = {"a": make_tensor((6, 4), torch.bfloat16, seed=1), "b": make_tensor((3,), torch.int32, seed=2)}
    save(tmp_path / "model.safetensors", tensors)
    reader = HuggingFaceStorageReader(tmp_path)
    target = {"a": torch.zeros(6, 4), "b": torch.zeros(3, dtype=torch.int32)}
    planner = DefaultLoadPlanner()
    metadata = reader.read_metadata()
    planner.set_up_planner(target, metadata, True)
    reader.set_up_storage_reader(metadata, True, rank=0, use_collectives=False)
    plans = reader.prepare_global_plan(planner.create_global_plan([reader.prepare_local_plan(
        planner.create_local_plan())]))
    done = reader.read_data(planner.finish_plan(plans[0]), planner)
    assert done.done() and done.wait() is None
    assert torch.equal(target["a"], tensors["a"].float()) and torch.equal(target["b"], tensors["b"])


def test_torchs_own_load_reads_through_the_readers(tmp_path):
    hf, shards = tmp_path / "hf", tmp_path / "shards"
    hf.mkdir()
    shards.mkdir()
    tensors = {"x": make_tensor((5, 3), torch.float16, seed=4), "y": torch.tensor(7)}
    save(hf / "model.safetensors", tensors)
    full = torch_shards(shards)
    target = {"x": torch.zeros(5, 3), "y": torch.tensor(0)}
    tdcp.load(target, storage_reader=HuggingFaceStorageReader(hf))
    assert torch.equal(target["x"], tensors["x"].float()) and torch.equal(target["y"], tensors["y"])
    sharded = {"w": torch.zeros(5, 4)}
    tdcp.load(sharded, storage_reader=TorchShardedSafetensorsReader(shards))
    assert torch.equal(sharded["w"], full)
    # torch's checkpoint_id resets the reader to that directory
    reader = HuggingFaceStorageReader(shards / "nowhere")
    again = {"x": torch.zeros(5, 3)}
    tdcp.load(again, checkpoint_id=str(hf), storage_reader=reader)
    assert torch.equal(again["x"], tensors["x"].float()) and reader.path == str(hf)


def test_the_remap_planner_reads_regions_straddling_torch_shard_files(tmp_path):
    full = torch_shards(tmp_path)
    # rows 1..3 of the transpose of w (4x5): columns 1..3 of w, cut across both shard files
    target = part(torch.zeros(3, 5), (1, 0), (4, 5))
    planner = RemapLoadPlanner({"wt": [RemapBlock((0, 0), (4, 5), "w", (0, 0), ((0, 1), (1, 0)))]})
    plan = seed_read(TorchShardedSafetensorsReader(tmp_path), planner, {"wt": target})
    assert torch.equal(target, full.t()[1:4])
    assert sorted((i.storage_index.fqn, tuple(i.storage_index.offset)) for i in plan.items) == [
        ("w", (0, 0)), ("w", (2, 0))]


def test_our_planners_plan_is_read_and_finished(tmp_path):
    tensors = {"a": make_tensor((4, 2), torch.bfloat16, seed=5)}
    save(tmp_path / "model.safetensors", tensors)
    reader = HuggingFaceStorageReader(tmp_path)
    planner = StandardPlanner()
    target = {"a": torch.zeros(4, 2, dtype=torch.float64)}  # filled through a temporary, then converted
    planner.set_up_load(target, reader.load_metadata().document, True)
    reader.configure_reader(None, is_coordinator=True, rank=0)
    reader.execute_read(planner.create_local_load_plan(), planner)
    assert torch.equal(target["a"], tensors["a"].double())


class CallsRecorded(HuggingFaceStorageReader):
    """The reader, noting which protocol's calls it gets."""

    calls: list[str]

    def read_metadata_bytes(self) -> bytes:
        self.calls = [*getattr(self, "calls", []), "read_metadata_bytes"]
        return super().read_metadata_bytes()

    def load_metadata(self, **kwargs: Any) -> Any:
        self.calls = [*getattr(self, "calls", []), "load_metadata"]
        return super().load_metadata(**kwargs)

    def read_metadata(self) -> Any:
        self.calls = [*getattr(self, "calls", []), "read_metadata"]
        return super().read_metadata()


def test_our_load_still_runs_our_loader(tmp_path):
    # the reader answers HyperParallel's and torch's calls now, yet load() reads it as ours
    tensors = {"a": make_tensor((3, 2), torch.bfloat16, seed=6)}
    save(tmp_path / "model.safetensors", tensors)
    reader = CallsRecorded(tmp_path)
    target = {"a": torch.zeros(3, 2)}
    load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["a"], tensors["a"].float())
    assert reader.calls == ["read_metadata_bytes"]


# ---------------------------------------------------------------------------- errors


def _f4(d: Path) -> None:
    raw(d / "model.safetensors", {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0")


def _no_shape(d: Path) -> None:
    raw(d / "model.safetensors", {"w": {"dtype": "F32", "data_offsets": [0, 0]}})


def _too_short(d: Path) -> None:
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 1024) + b"{}")


def _not_json(d: Path) -> None:
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 3) + b"{x}")


def _no_weight_map(d: Path) -> None:
    (d / "model.safetensors.index.json").write_bytes(b"{}")


def _in_two_files(d: Path) -> None:
    save(d / "model-00001-of-00002.safetensors", {"w": torch.zeros(3)})
    save(d / "model-00002-of-00002.safetensors", {"w": torch.ones(3), "b": torch.ones(2)})
    index(d, {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})


def _a_shard(d: Path) -> None:
    save(d / "model.safetensors", {"w": torch.zeros(2, 4)}, {"w": [2, 0]})


def _missing_file(d: Path) -> None:
    index(d, {"w": "model-00001-of-00002.safetensors"})


def _torch_shards_only(d: Path) -> None:
    save(d / SHARD_1, {"w": torch.zeros(2)}, {"w": [0]})


HF_ERRORS = [  # (directory, builtin class, our class, fragments of the message)
    (_f4, ValueError, UnsupportedValueError, ["F4"]),
    (_no_shape, ValueError, CorruptCheckpointError, ["'w'", "shape"]),
    (_too_short, ValueError, CorruptCheckpointError, ["model.safetensors", "too short"]),
    (_not_json, ValueError, CorruptCheckpointError, ["JSON"]),
    (_no_weight_map, ValueError, MetadataError, ["weight_map"]),
    (_in_two_files, ValueError, CorruptCheckpointError,
     ["'w'", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]),
    (_a_shard, ValueError, UnsupportedValueError, ["TorchShardedSafetensorsReader"]),
    (_missing_file, FileNotFoundError, CorruptCheckpointError, ["model-00001-of-00002.safetensors", "'w'"]),
    (lambda d: None, FileNotFoundError, NotACheckpointError, ["model.safetensors"]),
    (_torch_shards_only, FileNotFoundError, NotACheckpointError, ["TorchShardedSafetensorsReader"]),
]


@pytest.mark.parametrize("make,builtin,ours,fragments", HF_ERRORS, ids=[m[0].__name__ for m in HF_ERRORS])
def test_a_refused_hugging_face_directory_raises_ours_and_hyperparallels_class(tmp_path, make, builtin, ours,
                                                                                 fragments):
    make(tmp_path)
    for call in (lambda: HuggingFaceStorageReader(tmp_path).load_metadata(rank=0),
                 lambda: HuggingFaceStorageReader(tmp_path).read_metadata(),
                 lambda: load({"w": torch.zeros(2)}, storage_reader=HuggingFaceStorageReader(tmp_path), no_dist=True)):
        with pytest.raises(builtin) as caught:
            call()
        assert isinstance(caught.value, ours) and isinstance(caught.value, CheckpointError)
        assert all(f in str(caught.value) for f in fragments), str(caught.value)


def _two_shards(second: dict[str, torch.Tensor], offsets: dict[str, list[int]]) -> Any:
    def make(d: Path) -> None:
        save(d / SHARD_1, {"w": torch.zeros(2, 4)}, {"w": [0, 0]})
        save(d / SHARD_2, second, offsets)
    return make


def _offsets_for_one_of_two(d: Path) -> None:
    save(d / SHARD_1, {"w": torch.zeros(2), "b": torch.zeros(2)}, {"w": [0]})


def _indexed(d: Path) -> None:
    save(d / "model-00001-of-00001.safetensors", {"w": torch.zeros(2)})
    index(d, {"w": "model-00001-of-00001.safetensors"})


def _plain(d: Path) -> None:
    save(d / "model.safetensors", {"w": torch.zeros(2)})


SHARD_ERRORS = [
    ("gap", _two_shards({"w": torch.zeros(2, 4)}, {"w": [3, 0]}), ValueError, CorruptCheckpointError, ["'w'"]),
    ("overlap", _two_shards({"w": torch.zeros(2, 4)}, {"w": [1, 0]}), ValueError, CorruptCheckpointError,
     ["'w'", SHARD_1, SHARD_2]),
    ("same shard twice", _two_shards({"w": torch.zeros(2, 4)}, {"w": [0, 0]}), ValueError, CorruptCheckpointError,
     ["'w'", SHARD_1, SHARD_2]),
    ("dtypes", _two_shards({"w": torch.zeros(2, 4, dtype=torch.float16)}, {"w": [2, 0]}), ValueError,
     CorruptCheckpointError, ["'w'"]),
    ("offsets of one of two", _offsets_for_one_of_two, ValueError, CorruptCheckpointError, ["'b'"]),
    ("an index", _indexed, ValueError, UnsupportedValueError, ["HuggingFaceStorageReader"]),
    ("no offsets", _plain, ValueError, UnsupportedValueError, ["HuggingFaceStorageReader"]),
    ("empty", lambda d: None, FileNotFoundError, NotACheckpointError, ["safetensors"]),
]


@pytest.mark.parametrize("name,make,builtin,ours,fragments", SHARD_ERRORS, ids=[c[0] for c in SHARD_ERRORS])
def test_a_refused_shard_directory_raises_ours_and_hyperparallels_class(tmp_path, name, make, builtin, ours,
                                                                          fragments):
    make(tmp_path)
    with pytest.raises(builtin) as caught:
        TorchShardedSafetensorsReader(tmp_path).load_metadata()
    assert isinstance(caught.value, ours), name
    assert all(f in str(caught.value) for f in fragments), str(caught.value)


# ---------------------------------------------------------------------------- 2 gloo ranks


def _ranks_read_their_rows(rank: int, world: int, directory: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    with_torch = {"big": distribute_tensor(torch.zeros(64, 32), mesh, [Shard(0)]),
                  "col": distribute_tensor(torch.zeros(6, 10), mesh, [Shard(1)])}
    reader = HuggingFaceStorageReader(directory)
    tdcp.load(with_torch, storage_reader=reader)  # torch's loader, collectives on both ranks
    # HyperParallel's calls on this rank alone: rows 32*rank.. of "big" into a marked plain shard
    mine = part(torch.zeros(32, 32, dtype=torch.float64), (32 * rank, 0), (64, 32))
    seeded = HuggingFaceStorageReader(directory)
    seed_read(seeded, RemapLoadPlanner({"big": [RemapBlock((0, 0), (64, 32), "big", (0, 0), EYE2)]}),
              {"big": mine}, rank=rank)
    return {"big": with_torch["big"].to_local().tolist(), "col": with_torch["col"].to_local().tolist(),
            "mine": mine.tolist(), "torch_bytes": reader.bytes_read, "seed_bytes": seeded.bytes_read}


def test_each_rank_reads_its_shard_through_torchs_load_and_hyperparallels_calls(tmp_path):
    tensors = {"big": make_tensor((64, 32), seed=10), "col": make_tensor((6, 10), torch.bfloat16, seed=11)}
    save(tmp_path / "model.safetensors", tensors)
    out = run_ranks(_ranks_read_their_rows, 2, str(tmp_path))
    for rank, got in enumerate(out):
        rows = slice(32 * rank, 32 * rank + 32)
        assert got["big"] == tensors["big"][rows].tolist()  # tensors do not cross the process boundary
        assert got["col"] == tensors["col"][:, 5 * rank:5 * rank + 5].float().tolist()
        assert got["mine"] == tensors["big"][rows].double().tolist()
        # each rank read its half of "big" (4 KiB of 8 KiB), not the whole tensor
        assert got["seed_bytes"] < 32 * 32 * 4 + 1024
        assert got["torch_bytes"] < 64 * 32 * 4
