"""torch-protocol load plans on our format: torch's own planners read our checkpoints through
``read_metadata()`` (a torch ``Metadata`` view) and :func:`transfer.torch_reads.read_torch_items`."""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata as TorchMetadata
from torch.distributed.checkpoint.metadata import TensorStorageMetadata as TorchTSM

from hyper_parallel.core.distributed_checkpoint import save
from hyper_parallel.core.distributed_checkpoint._src.base.errors import CheckpointError, CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint._src.format.metadata import Metadata as Document
from hyper_parallel.core.distributed_checkpoint._src.transfer.torch_reads import read_torch_items
from hyper_parallel.core.distributed_checkpoint.filesystem import FileSystemReader, FileSystemWriter
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, ReadItem


def _state() -> dict:
    return {"w": torch.arange(24.0).reshape(6, 4), "b": torch.arange(5, dtype=torch.int64),
            "step": 7, "cfg": {"lr": 0.5, "name": "adam"}, "raw": b"\x00\x01bytes"}


def _run(planner, sd, path: str) -> None:
    """torch's load call order, one process: metadata, plans, reads."""
    reader = FileSystemReader(path)
    view = reader.read_metadata()
    planner.set_up_planner(sd, view, True)
    plan = planner.create_local_plan()
    plan = planner.create_global_plan([plan])[0]
    plan = planner.finish_plan(plan)
    read_torch_items(view.document, reader, plan.items, planner, where=path)


def test_read_metadata_is_torch_metadata_built_per_key(tmp_path):
    save(_state(), str(tmp_path / "ck"), no_dist=True)
    view = FileSystemReader(str(tmp_path / "ck")).read_metadata()
    assert isinstance(view, TorchMetadata) and isinstance(view, Metadata)
    assert not view.state_dict_metadata._cache  # nothing built until asked
    w = view.state_dict_metadata["w"]
    assert isinstance(w, TorchTSM) and isinstance(w, TensorStorageMetadata)
    assert tuple(w.size) == (6, 4) and w.properties.dtype == torch.float32
    assert [tuple(c.sizes) for c in w.chunks] == [(6, 4)]
    assert set(view.state_dict_metadata._cache) == {"w"}
    assert sorted(view.state_dict_metadata) == sorted(["w", "b", "step", "cfg.lr", "cfg.name", "raw"])
    assert "cfg" not in view.state_dict_metadata and "cfg.lr" in view.state_dict_metadata
    assert view.planner_data["cfg.lr"] == ("cfg", "lr")
    assert view.save_id == view.document.save_id and view.world_size == 1  # the document's fields
    raw = FileSystemReader(str(tmp_path / "ck")).read_metadata_bytes()
    assert Document.from_json(raw).save_id == view.save_id


def test_torch_default_load_planner_reads_our_checkpoint(tmp_path):
    src = _state()
    save(src, str(tmp_path / "ck"), no_dist=True)
    sd = {"w": torch.zeros(6, 4), "b": torch.zeros(5, dtype=torch.int64), "step": 0,
          "cfg": {"lr": 0.0, "name": ""}, "raw": b""}
    _run(DefaultLoadPlanner(), sd, str(tmp_path / "ck"))
    assert torch.equal(sd["w"], src["w"]) and torch.equal(sd["b"], src["b"])
    assert sd["step"] == 7 and sd["cfg"] == {"lr": 0.5, "name": "adam"} and sd["raw"] == b"\x00\x01bytes"


def test_empty_state_dict_planner_loads_everything(tmp_path):
    src = _state()
    save(src, str(tmp_path / "ck"), no_dist=True)
    sd: dict = {}
    _run(_EmptyStateDictLoadPlanner(), sd, str(tmp_path / "ck"))
    assert torch.equal(sd["w"], src["w"]) and sd["cfg"] == {"lr": 0.5, "name": "adam"}


class _Renaming(DefaultLoadPlanner):
    """Targets named ``model.<key>`` read the checkpoint's ``<key>`` and are doubled on commit."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.renamed = state_dict
        super().set_up_planner({k.removeprefix("model."): v for k, v in state_dict.items()}, metadata,
                               is_coordinator)

    def commit_tensor(self, read_item, tensor):
        tensor.mul_(2)


def test_a_subclass_overriding_hooks_gets_them_called(tmp_path):
    src = _state()
    save(src, str(tmp_path / "ck"), no_dist=True)
    sd = {"model.w": torch.zeros(6, 4)}
    planner = _Renaming(allow_partial_load=True)
    _run(planner, sd, str(tmp_path / "ck"))
    assert torch.equal(sd["model.w"], src["w"] * 2)


def test_resharded_rows_and_a_dtype_conversion(tmp_path):
    # saved as two row blocks by two "ranks" is not needed: a target chunk across the whole
    # saved tensor, and a bfloat16 target of a float32 save, are read and converted
    src = {"w": torch.randn(8, 6)}
    save(src, str(tmp_path / "ck"), no_dist=True)
    sd = {"w": torch.zeros(8, 6, dtype=torch.bfloat16)}
    _run(DefaultLoadPlanner(), sd, str(tmp_path / "ck"))
    assert torch.equal(sd["w"], src["w"].to(torch.bfloat16))


def test_a_read_outside_the_saved_tensor_names_the_key(tmp_path):
    save({"w": torch.zeros(2, 2)}, str(tmp_path / "ck"), no_dist=True)
    reader = FileSystemReader(str(tmp_path / "ck"))
    view = reader.read_metadata()
    item = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("w", (0, 0)), dest_offsets=(0, 0),
                    storage_index=MetadataIndex("w", (0, 0)), storage_offsets=(1, 0), lengths=(2, 2))
    with pytest.raises(CheckpointError, match="'w'.*outside its saved shape"):
        read_torch_items(view.document, reader, [item], DefaultLoadPlanner())
    gone = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("v", (0,)), dest_offsets=(0,),
                    storage_index=MetadataIndex("v", (0,)), storage_offsets=(0,), lengths=(1,))
    with pytest.raises(CheckpointError, match="'v', which the checkpoint does not hold"):
        read_torch_items(view.document, reader, [gone], DefaultLoadPlanner())


def test_a_damaged_byte_is_caught(tmp_path):
    save({"w": torch.arange(4096.0)}, str(tmp_path / "ck"), no_dist=True)
    data = [f for f in os.listdir(tmp_path / "ck") if not f.startswith(".")][0]
    at = os.path.getsize(tmp_path / "ck" / data) // 2  # inside the tensor's 16 KiB
    with open(tmp_path / "ck" / data, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError):
        _run(DefaultLoadPlanner(), {"w": torch.zeros(4096)}, str(tmp_path / "ck"))


def test_a_pickled_value_needs_the_opt_in(tmp_path):
    save({"o": {1, 2}}, str(tmp_path / "ck"), no_dist=True, allow_pickle=True)
    reader = FileSystemReader(str(tmp_path / "ck"))
    view = reader.read_metadata()
    planner, sd = _EmptyStateDictLoadPlanner(), {}
    planner.set_up_planner(sd, view, True)
    plan = planner.create_local_plan()
    with pytest.raises(CheckpointError, match="'o'.*allow_pickle"):
        read_torch_items(view.document, reader, plan.items, planner)
    read_torch_items(view.document, reader, plan.items, planner, allow_pickle=True)
    assert sd["o"] == {1, 2}


def rank_torch_planner_on_our_format(rank: int, ws: int, root: str) -> bool:
    from helpers import local_expected, make_dtensor, make_tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from hyper_parallel.core.distributed_checkpoint import load

    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("x",))
    full = make_tensor((7, 6))
    save({"w": make_dtensor(full, mesh, [Shard(0)]), "step": 4}, root)
    target = {"model.w": make_dtensor(torch.zeros(7, 6), mesh, [Shard(1)])}
    load(target, checkpoint_id=root, planner=_Renaming(allow_partial_load=True))  # our load, torch's planner
    return torch.equal(target["model.w"].to_local(), local_expected(full, mesh, [Shard(1)]) * 2)


def test_a_torch_planner_reshards_our_checkpoint_on_two_ranks(tmp_path):
    from multiprocess import run_ranks

    assert all(run_ranks(rank_torch_planner_on_our_format, 2, str(tmp_path / "ck")))


def test_storage_meta_names_the_save_and_the_load(tmp_path):
    writer = FileSystemWriter(str(tmp_path / "ck"))
    save({"a": torch.zeros(4, 4)}, storage_writer=writer, no_dist=True)
    reader = FileSystemReader(str(tmp_path / "ck"))
    meta = reader.read_metadata().storage_meta
    assert str(meta.checkpoint_id) == str(tmp_path / "ck")
    assert meta.save_id == writer.save_id and writer.save_id  # torch's StorageWriter.save_id
    assert meta.load_id == reader.load_id and reader.load_id != FileSystemReader(str(tmp_path / "ck")).load_id
