"""HuggingFaceStorageWriter on torch DCP's writer protocol (``interop/hf_torch_writes.py``).

torch's own ``save`` drives our writer (``set_up_storage_writer`` ... ``write_data``, ``finish``)
on one process and on two gloo ranks holding DTensor shards; the files are read back bit-exact
with ``safetensors`` itself and with our readers. The calls torch's unit tests make by hand
(``write_data`` on a plan built without a global step, ``finish`` with results) are checked
against the files' own headers.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import bits, make_dtensor, make_tensor
from multiprocess import run_ranks
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_bytesio, _create_write_item_for_tensor

from hyper_parallel.core.distributed_checkpoint import (
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
    TorchShardedSafetensorsReader,
    UnsupportedValueError,
    load,
)

INDEX = "model.safetensors.index.json"
MAPPING = {"w": 1, "col": 2, "rep": 1, "plain": 2, "empty": 2}


def _full() -> dict[str, torch.Tensor]:
    return {
        "w": make_tensor((7, 5), seed=1),  # Shard(0), uneven
        "col": make_tensor((6, 10), torch.bfloat16, seed=2),  # Shard(1): a box of short rows
        "rep": make_tensor((5, 3), torch.float16, seed=3),  # Replicate
        "plain": make_tensor((4,), torch.int64, seed=4),
        "empty": torch.zeros(0, 3),
    }


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(bits(got[k]), bits(v)), k


def _files(d: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, name)))
    return out


def test_torch_save_writes_a_hugging_face_checkpoint_through_our_writer(tmp_path):
    d = str(tmp_path / "hf")
    sd = _full()
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(d, MAPPING), no_dist=True)
    assert sorted(os.listdir(d)) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX]
    index = json.load(open(os.path.join(d, INDEX)))
    assert index["weight_map"] == {k: f"model-0000{i}-of-00002.safetensors" for k, i in MAPPING.items()}
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in sd.values())
    for name in set(index["weight_map"].values()):  # each file holds exactly what the index gives it
        assert set(load_file(os.path.join(d, name))) == {k for k, f in index["weight_map"].items() if f == name}
    _same(_files(d), sd)
    _same(load(storage_reader=HuggingFaceStorageReader(d), no_dist=True), sd)


def test_write_data_reports_where_each_item_lies_and_finish_puts_the_files_in_place(tmp_path):
    d = str(tmp_path / "hf")
    sd = {"a": make_tensor((3, 4), seed=1), "b": make_tensor((5,), torch.int64, seed=2),
          "c": make_tensor((2, 2), torch.bfloat16, seed=3)}
    writer = HuggingFaceStorageWriter(d, {"a": 1, "b": 1, "c": 2})
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=sd)
    plan = SavePlan([_create_write_item_for_tensor(k, v) for k, v in sd.items()])
    future = writer.write_data(plan, planner)
    future.wait()
    results = future.value()
    assert [r.index.fqn for r in results] == ["a", "b", "c"]
    assert not [n for n in os.listdir(d) if n.endswith(".safetensors")]  # nothing in place before finish
    writer.finish(None, [results])
    assert not [n for n in os.listdir(d) if ".tmp-" in n], os.listdir(d)
    for r in results:  # offset and length: the tensor's data_offsets in its file's header
        with open(os.path.join(d, r.storage_data.relative_path), "rb") as f:
            head = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        start, end = head[r.index.fqn]["data_offsets"]
        assert (r.storage_data.offset, r.storage_data.length, r.size_in_bytes) == (start, end - start, end - start)
    assert json.load(open(os.path.join(d, INDEX)))["weight_map"] == {
        "a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors"}
    _same(_files(d), sd)


def test_a_value_that_is_not_a_tensor_is_refused_naming_it_and_nothing_is_put_in_place(tmp_path):
    d = str(tmp_path / "hf")
    with pytest.raises(CheckpointException, match="UnsupportedValueError: 'step' is a plain value"):
        dcp.save({"w": torch.ones(2), "step": 3}, storage_writer=HuggingFaceStorageWriter(d), no_dist=True)
    writer = HuggingFaceStorageWriter(d)  # called directly: our error itself
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict={"w": torch.ones(2), "step": 3})
    plan = SavePlan([_create_write_item_for_tensor("w", torch.ones(2)), _create_write_item_for_bytesio("step", 3)])
    with pytest.raises(UnsupportedValueError, match="'step' is a plain value"):
        writer.write_data(plan, planner)
    assert not [n for n in os.listdir(d) if n.endswith((".safetensors", ".json"))], os.listdir(d)


def test_a_save_replaces_an_earlier_export_in_the_directory(tmp_path):
    d = str(tmp_path / "hf")
    dcp.save({f"l{i}": torch.full((4,), float(i)) for i in range(3)},
             storage_writer=HuggingFaceStorageWriter(d, {f"l{i}": i + 1 for i in range(3)}), no_dist=True)
    assert len(os.listdir(d)) == 4
    new = {"x": make_tensor((3, 3), seed=9)}
    dcp.save(new, storage_writer=HuggingFaceStorageWriter(d), no_dist=True)
    assert sorted(os.listdir(d)) == ["model-00001-of-00001.safetensors", INDEX]  # the old shards are gone
    _same(load(storage_reader=HuggingFaceStorageReader(d), no_dist=True), new)


def _torch_save_on_ranks(rank: int, ws: int, d: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (ws,))
    placements = {"w": Shard(0), "col": Shard(1), "rep": Replicate()}
    sd = {k: make_dtensor(v, mesh, [placements[k]]) if k in placements else v.clone() for k, v in _full().items()}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(os.path.join(d, "cons"), MAPPING))
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(os.path.join(d, "shards"), MAPPING, save_distributed=True))


@pytest.fixture(scope="module")
def two_rank_output(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hf_torch_writes"))
    run_ranks(_torch_save_on_ranks, 2, d, timeout_s=240)
    return d


def test_torch_save_on_two_ranks_writes_every_tensor_whole_into_shared_files(two_rank_output):
    d = os.path.join(two_rank_output, "cons")
    assert sorted(os.listdir(d)) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX]
    _same(_files(d), _full())
    with safe_open(os.path.join(d, "model-00002-of-00002.safetensors"), "pt") as f:  # one header, both ranks' rows
        assert sorted(f.keys()) == ["col", "empty", "plain"]
    index = json.load(open(os.path.join(d, INDEX)))
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in _full().values())


def test_torch_save_on_two_ranks_in_torchs_sharded_format(two_rank_output):
    d = os.path.join(two_rank_output, "shards")
    names = sorted(os.listdir(d))
    assert names == [f"shard-0000{r}-model-0000{i}-of-00002.safetensors" for r in (1, 2) for i in (1, 2)], names
    _same(load(storage_reader=TorchShardedSafetensorsReader(d), no_dist=True), _full())
