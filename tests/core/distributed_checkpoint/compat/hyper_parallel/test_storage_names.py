"""HyperParallel's storage names: ``storage.METADATA_FILE_NAME``, ``StorageInfo``, the per-item
``WriteResult(index=, storage_data=)``, and ``hf_storage``'s header and index names (torch's
values), beside the names our own storage and torch's keep."""

from __future__ import annotations

import pytest
import torch.distributed.checkpoint._hf_utils as torch_hf
from torch.distributed.checkpoint.metadata import MetadataIndex

from hyper_parallel.core.distributed_checkpoint import hf_storage, storage
from hyper_parallel.core.distributed_checkpoint._src.format.metadata import FileRecord
from hyper_parallel.core.distributed_checkpoint._src.interop.huggingface import reader as huggingface
from hyper_parallel.core.distributed_checkpoint._src.interop.huggingface import writer as hf_writer
from hyper_parallel.core.distributed_checkpoint._src.interop.huggingface.index import HF_INDEX
from hyper_parallel.core.distributed_checkpoint.storage import METADATA_FILE_NAME, StorageInfo, WriteResult


def test_the_metadata_file_is_torch_dcp_s_name():
    assert METADATA_FILE_NAME == ".metadata"


def test_storage_info_takes_the_seed_s_fields_and_torch_s_transforms_by_keyword():
    info = StorageInfo("shard.safetensors", 0, -1, "w")
    assert (info.relative_path, info.offset, info.length, info.tensor_key) == ("shard.safetensors", 0, -1, "w")
    assert info.transform_descriptors is None
    assert StorageInfo(relative_path="a", offset=8, length=4, transform_descriptors=["zstd"]).transform_descriptors \
        == ["zstd"]


def test_write_result_takes_the_per_item_form_by_keyword():
    info = StorageInfo(relative_path="_rank0_.safetensors", offset=0, length=-1)
    result = WriteResult(index=MetadataIndex("weight", (0, 0), 0), storage_data=info, size_in_bytes=64)
    assert result.index.fqn == "weight" and result.storage_data is info and result.size_in_bytes == 64
    assert result.files == [] and result.rows == []


def test_our_positional_write_result_keeps_its_fields_and_the_coordinator_copy_drops_the_item_form():
    files = [FileRecord("0.data")]
    result = WriteResult(files, {"k": 1}, [], 5)
    assert (result.files, result.objects, result.nbytes, result.index) == (files, {"k": 1}, 5, None)
    assert result.for_coordinator().storage_data is None


@pytest.mark.parametrize("name", ["DCP_SHARDING_INFO_KEY", "SAVED_OFFSETS_KEY"])
def test_the_hf_header_names_are_torch_s(name):
    assert getattr(hf_storage, name) == getattr(torch_hf, name)


def test_the_index_suffix_names_the_index_file_and_the_readers_use_the_same_strings():
    assert hf_storage.SAFETENSORS_INDEX_SUFFIX == ".safetensors.index.json"
    assert HF_INDEX == "model" + hf_storage.SAFETENSORS_INDEX_SUFFIX
    assert huggingface._TORCH_SHARDING == hf_writer._SHARDING_INFO == hf_storage.DCP_SHARDING_INFO_KEY
    assert huggingface._SAVED_OFFSETS == hf_writer._SAVED_OFFSETS == hf_storage.SAVED_OFFSETS_KEY


def test_the_storage_face_keeps_the_protocols():
    names = {"StorageWriter", "StorageReader", "WriteResult", "StorageInfo", "METADATA_FILE_NAME"}
    assert names <= set(storage.__all__)
