"""Hugging Face safetensors storage (torch's module name ``torch.distributed.checkpoint.hf_storage``).

A face over :mod:`._src.interop.huggingface.writer` (save straight to safetensors, consolidated or in
torch's sharded format) and :mod:`._src.interop.huggingface.reader` (load and reshard from them; the
HyperParallel's ``TorchShardedSafetensorsReader`` joins the shard files torch's writer leaves), with the
HyperParallel's names for the strings those files use (:mod:`._src.interop.huggingface.index`; torch's values):
``DCP_SHARDING_INFO_KEY`` (the safetensors header entry where torch's writer records each
shard), ``SAVED_OFFSETS_KEY`` (a shard's offsets in the whole tensor, inside that entry) and
``SAFETENSORS_INDEX_SUFFIX`` (how an index file's name ends). The readers also answer
HyperParallel's reader calls (``load_metadata``, ``configure_reader``, ``execute_read``) and torch's
(``read_metadata``, ``set_up_storage_reader``, ``read_data``): :mod:`._src.interop.huggingface.protocols`.
"""

from torch.distributed.checkpoint.hf_storage import _metadata_fn as _metadata_fn  # torch's index file name

from ._src.interop.huggingface.index import DCP_SHARDING_INFO_KEY, SAFETENSORS_INDEX_SUFFIX, SAVED_OFFSETS_KEY
from ._src.interop.huggingface.reader import HuggingFaceStorageReader, TorchShardedSafetensorsReader
from ._src.interop.huggingface.writer import HuggingFaceStorageWriter

__all__ = ["HuggingFaceStorageWriter", "HuggingFaceStorageReader", "TorchShardedSafetensorsReader",
           "DCP_SHARDING_INFO_KEY", "SAFETENSORS_INDEX_SUFFIX", "SAVED_OFFSETS_KEY"]
