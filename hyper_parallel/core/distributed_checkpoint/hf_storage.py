"""Hugging Face safetensors storage (torch's module name ``torch.distributed.checkpoint.hf_storage``).

A face over :mod:`.interop.hf_writer` (save straight to safetensors, consolidated or in
torch's sharded format) and :mod:`.interop.huggingface` (load and reshard from them; the
seed's ``TorchShardedSafetensorsReader`` joins the shard files torch's writer leaves), with the
seed's names for the strings those files use (:mod:`.interop.hf_index`; torch's values):
``DCP_SHARDING_INFO_KEY`` (the safetensors header entry where torch's writer records each
shard), ``SAVED_OFFSETS_KEY`` (a shard's offsets in the whole tensor, inside that entry) and
``SAFETENSORS_INDEX_SUFFIX`` (how an index file's name ends). The readers also answer the
seed's reader calls (``load_metadata``, ``configure_reader``, ``execute_read``) and torch's
(``read_metadata``, ``set_up_storage_reader``, ``read_data``): :mod:`.interop.hf_protocols`.
"""

from torch.distributed.checkpoint.hf_storage import _metadata_fn as _metadata_fn  # torch's index file name

from .interop.hf_index import DCP_SHARDING_INFO_KEY, SAFETENSORS_INDEX_SUFFIX, SAVED_OFFSETS_KEY
from .interop.hf_writer import HuggingFaceStorageWriter
from .interop.huggingface import HuggingFaceStorageReader, TorchShardedSafetensorsReader

__all__ = ["HuggingFaceStorageWriter", "HuggingFaceStorageReader", "TorchShardedSafetensorsReader",
           "DCP_SHARDING_INFO_KEY", "SAFETENSORS_INDEX_SUFFIX", "SAVED_OFFSETS_KEY"]
