"""torch's private ``_consolidate_hf_safetensors`` at our path: the sharded Hugging Face files two
gloo ranks wrote (uneven DTensor shards) consolidated into whole-tensor files and an index, on
every rank (each writing its own files) and in one process; bit-exact, the same files and
tensors as torch's own consolidation of the same shards, any dtype; bad mappings refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import make_tensor
from multiprocess import run_ranks
from safetensors import safe_open

from hyper_parallel.core.distributed_checkpoint import HuggingFaceStorageWriter, save
from hyper_parallel.core.distributed_checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files,
    consolidate_safetensors_files_on_every_rank,
)
from hyper_parallel.core.distributed_checkpoint._src.base.errors import RankFailedError, StateDictMismatchError

TENSORS = {"a.weight": ((7, 5), torch.float32), "b.weight": ((5, 3), torch.bfloat16),
           "c.bias": ((9,), torch.float32), "d.count": ((3, 2), torch.int64)}
MAPPING = {"a.weight": 1, "b.weight": 2, "c.bias": 2, "d.count": 3}
FLOATS = {k: i for k, i in MAPPING.items() if TENSORS[k][1].is_floating_point}


def full(key: str) -> torch.Tensor:
    shape, dtype = TENSORS[key]
    return make_tensor(shape, dtype, seed=sorted(TENSORS).index(key) + 1)


def _two_ranks(rank: int, ws: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    sharded = os.path.join(root, "sharded")
    save({k: distribute_tensor(full(k), mesh, [Shard(0)]) for k in TENSORS},
         storage_writer=HuggingFaceStorageWriter(sharded, save_distributed=True))
    consolidate_safetensors_files_on_every_rank(sharded, os.path.join(root, "every_rank"), MAPPING, num_threads=2)
    try:
        consolidate_safetensors_files_on_every_rank(sharded, os.path.join(root, "bad"), {**MAPPING, "nope": 1})
    except RankFailedError as exc:  # every rank fails alike, naming the key
        assert "'nope'" in str(exc) and "do not hold" in str(exc), str(exc)
    else:
        raise AssertionError("a mapping naming a missing tensor was consolidated")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("consolidate"))
    run_ranks(_two_ranks, 2, root, timeout_s=180)
    return root


def _read(directory: str) -> tuple[dict, dict[str, tuple[str, torch.Tensor]]]:
    index = json.loads(open(os.path.join(directory, "model.safetensors.index.json")).read())
    out = {}
    for key, name in index["weight_map"].items():
        with safe_open(os.path.join(directory, name), "pt") as f:
            out[key] = (name, f.get_tensor(key))
    return index, out


def test_the_shards_are_many_files_of_pieces(shards):
    files = sorted(os.listdir(os.path.join(shards, "sharded")))
    assert len([f for f in files if f.endswith(".safetensors")]) >= 2, files


def test_on_every_rank_writes_each_file_once_and_an_index_of_all(shards):
    index, got = _read(os.path.join(shards, "every_rank"))
    assert index["weight_map"] == {k: f"model-{i:05d}-of-00003.safetensors" for k, i in MAPPING.items()}
    assert index["metadata"]["total_size"] == sum(full(k).numel() * full(k).element_size() for k in TENSORS)
    for key, (_, tensor) in got.items():
        assert tensor.dtype == full(key).dtype and torch.equal(tensor, full(key)), key
    leftovers = [n for n in os.listdir(os.path.join(shards, "every_rank")) if ".tmp-" in n]
    assert leftovers == []
    assert not os.path.exists(os.path.join(shards, "bad", "model.safetensors.index.json"))  # no index on failure


def test_in_one_process_the_same_as_torchs_own_consolidation(shards, tmp_path):
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files as torch_consolidate,
    )

    sharded = os.path.join(shards, "sharded")
    with pytest.warns(UserWarning, match="d.count"):  # left out: torch's takes floating dtypes only
        consolidate_safetensors_files(sharded, str(tmp_path / "ours"), FLOATS)
    os.makedirs(tmp_path / "torch")  # torch's does not create it
    torch_consolidate(sharded, str(tmp_path / "torch"), FLOATS)
    ours_index, ours = _read(str(tmp_path / "ours"))
    theirs_index, theirs = _read(str(tmp_path / "torch"))
    assert ours_index == theirs_index
    assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "torch"))
    for key in FLOATS:
        assert ours[key][0] == theirs[key][0] and torch.equal(ours[key][1], theirs[key][1]), key


def test_no_mapping_writes_one_file_of_every_tensor(shards, tmp_path):
    consolidate_safetensors_files(os.path.join(shards, "sharded"), str(tmp_path))
    index, got = _read(str(tmp_path))
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    assert all(torch.equal(got[k][1], full(k)) for k in TENSORS)


def test_a_mapped_tensor_the_shards_lack_is_refused_by_name(shards, tmp_path):
    with pytest.raises(StateDictMismatchError, match=r"'missing.weight'"):
        consolidate_safetensors_files(os.path.join(shards, "sharded"), str(tmp_path), {**MAPPING, "missing.weight": 1})
    assert not os.path.exists(tmp_path / "model.safetensors.index.json")


def test_tensors_the_mapping_leaves_out_are_named_in_a_warning(shards, tmp_path):
    with pytest.warns(UserWarning, match=r"d\.count"):
        consolidate_safetensors_files(os.path.join(shards, "sharded"), str(tmp_path), FLOATS)
    assert "d.count" not in _read(str(tmp_path))[0]["weight_map"]


@pytest.mark.parametrize("bad", [{"a.weight": 0}, {"a.weight": "1"}])
def test_a_mapping_index_that_is_not_a_positive_int_is_refused(shards, tmp_path, bad):
    with pytest.raises(ValueError, match="file indices are ints from 1"):
        consolidate_safetensors_files(os.path.join(shards, "sharded"), str(tmp_path), bad)
