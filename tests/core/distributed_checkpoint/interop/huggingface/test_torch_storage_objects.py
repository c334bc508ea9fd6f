"""torch's HuggingFaceStorageWriter / HuggingFaceStorageReader / QuantizedHuggingFaceStorageReader
objects taken as configuration for ours (as torch's filesystem ones are): converted with their
options, and save/load/async_save through them write and read real Hugging Face files that
stock torch reads too. One process, real files."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from helpers import make_tensor
from safetensors import safe_open

from hyper_parallel.core.distributed_checkpoint import (
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
    QuantizedHuggingFaceStorageReader,
    async_save,
    load,
    save,
)
from hyper_parallel.core.distributed_checkpoint._src.backends.torch_storage import as_our_reader, as_our_writer


def _state() -> dict[str, torch.Tensor]:
    return {"embed.weight": make_tensor((6, 4), seed=1), "head.bias": make_tensor((3,), torch.bfloat16, seed=2),
            "steps": make_tensor((2, 2), torch.int64, seed=3)}


def test_torch_writer_options_carry_over(tmp_path):
    theirs = tdcp.HuggingFaceStorageWriter(str(tmp_path / "hf"), fqn_to_index_mapping={"a": 1, "b": 2},
                                           thread_count=3, save_distributed=True, thread_count_consolidation=2)
    ours = as_our_writer(theirs)
    assert type(ours) is HuggingFaceStorageWriter
    assert (ours.path, ours.fqn_to_index_mapping, ours.thread_count, ours.save_distributed,
            ours.enable_consolidation, ours.thread_count_consolidation) == (
        str(tmp_path / "hf"), {"a": 1, "b": 2}, 3, True, False, 2)
    # consolidation: torch moves its shards under path/sharded; the whole tensors go to path either way
    ours = as_our_writer(tdcp.HuggingFaceStorageWriter(str(tmp_path / "c"), enable_consolidation=True))
    assert ours.enable_consolidation and ours.consolidated_output_path == str(tmp_path / "c")


def test_torch_reader_options_carry_over(tmp_path):
    ours = as_our_reader(tdcp.HuggingFaceStorageReader(str(tmp_path), thread_count=4))
    assert type(ours) is HuggingFaceStorageReader and ours.thread_count == 4
    ours = as_our_reader(tdcp.QuantizedHuggingFaceStorageReader(str(tmp_path), thread_count=2,
                                                                target_dtype=torch.bfloat16, block_size=64))
    assert type(ours) is QuantizedHuggingFaceStorageReader
    assert (ours.thread_count, ours.target_dtype, ours.block_size) == (2, torch.bfloat16, 64)


def test_a_subclass_overriding_a_hook_is_not_taken_as_configuration(tmp_path):
    class Counting(tdcp.HuggingFaceStorageReader):
        def read_data(self, plan, planner):
            return super().read_data(plan, planner)

    reader = Counting(str(tmp_path))
    assert as_our_reader(reader, foreign_ok=True) is reader  # run on torch's protocol, its hook called


def test_save_through_torchs_writer_writes_files_stock_torch_reads(tmp_path):
    sd = _state()
    save(sd, storage_writer=tdcp.HuggingFaceStorageWriter(str(tmp_path)), no_dist=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(sd)
    for key, name in index["weight_map"].items():
        with safe_open(str(tmp_path / name), "pt") as f:
            assert torch.equal(f.get_tensor(key), sd[key])
    theirs = {k: torch.zeros_like(v) for k, v in sd.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.load(theirs, storage_reader=tdcp.HuggingFaceStorageReader(str(tmp_path)), no_dist=True)
    assert all(torch.equal(theirs[k], sd[k]) for k in sd)


def test_load_through_torchs_reader_fills_targets_bit_exact(tmp_path):
    sd = _state()
    save(sd, storage_writer=HuggingFaceStorageWriter(str(tmp_path)), no_dist=True)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    load(out, storage_reader=tdcp.HuggingFaceStorageReader(str(tmp_path)), no_dist=True)
    assert all(torch.equal(out[k], sd[k]) for k in sd)


@pytest.mark.parametrize("consolidation", [False, True])
def test_async_save_through_torchs_writer(tmp_path, consolidation):
    sd = _state()
    writer = tdcp.HuggingFaceStorageWriter(str(tmp_path), enable_consolidation=consolidation)
    async_save(sd, storage_writer=writer, no_dist=True).result(timeout=120)
    assert not os.path.exists(tmp_path / "sharded")  # ours writes the whole tensors in place
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    load(out, storage_reader=tdcp.HuggingFaceStorageReader(str(tmp_path)), no_dist=True)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
