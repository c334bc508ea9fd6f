"""torch's Hugging Face storage objects as configuration for ours.

Code written for torch DCP hands ``save``/``load``/``async_save`` torch's own
``HuggingFaceStorageWriter``, ``HuggingFaceStorageReader`` or
``QuantizedHuggingFaceStorageReader`` (torchtitan's initial load from HF weights, its last
step saved as HF safetensors). Each is converted to this library's class of the same name,
with the same options, as torch's ``FileSystemWriter``/``FileSystemReader`` are
(:mod:`...backends.torch_storage`); the conversions are registered with
:mod:`...backends.storage_mappings` when this module is imported (the package imports it).

What maps (torch option -> ours):

- writer: ``path`` (with ``enable_consolidation``, torch writes its shards under
  ``path/sharded`` and the whole tensors to ``path``; ours writes the whole tensors to ``path``
  directly, with no sharded copy), ``fqn_to_index_mapping``, ``thread_count``,
  ``save_distributed``, ``enable_consolidation``, ``thread_count_consolidation``,
  ``sync_files``;
- readers: ``path``, ``thread_count``; the quantized reader's ``target_dtype`` and ``block_size``.

A subclass of torch's classes that overrides a method is not converted; ``save``/``load`` then
run it through torch's protocol.

What it is not: our Hugging Face readers and writer (:mod:`.reader`, :mod:`.quantized`,
:mod:`.writer`).
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint import hf_storage as _torch_hf
from torch.distributed.checkpoint import quantized_hf_storage as _torch_quantized

from ...backends.storage_mappings import register
from .quantized import QuantizedHuggingFaceStorageReader
from .reader import HuggingFaceStorageReader
from .writer import HuggingFaceStorageWriter

__all__ = ["writer_from_torch", "reader_from_torch", "quantized_reader_from_torch"]


def writer_from_torch(writer: Any) -> HuggingFaceStorageWriter:
    """Our :class:`~.writer.HuggingFaceStorageWriter` for torch's, with its options."""
    consolidated = getattr(writer, "consolidated_output_path", None)
    path = consolidated if writer.enable_consolidation and consolidated is not None else writer.path
    return HuggingFaceStorageWriter(
        os.fspath(path), writer.fqn_to_index_mapping, thread_count=writer.thread_count,
        save_distributed=writer.save_distributed, enable_consolidation=writer.enable_consolidation,
        thread_count_consolidation=writer.thread_count_consolidation, sync_files=writer.sync_files)


def reader_from_torch(reader: Any) -> HuggingFaceStorageReader:
    """Our :class:`~.reader.HuggingFaceStorageReader` for torch's, with its options."""
    return HuggingFaceStorageReader(os.fspath(reader.path), reader.thread_count)


def quantized_reader_from_torch(reader: Any) -> QuantizedHuggingFaceStorageReader:
    """Our :class:`~.quantized.QuantizedHuggingFaceStorageReader` for torch's, with its options."""
    return QuantizedHuggingFaceStorageReader(os.fspath(reader.path), reader.thread_count,
                                             target_dtype=reader.target_dtype, block_size=reader.block_size)


register(_torch_hf.HuggingFaceStorageWriter, "writer", writer_from_torch)
register(_torch_hf.HuggingFaceStorageReader, "reader", reader_from_torch)
register(_torch_quantized.QuantizedHuggingFaceStorageReader, "reader", quantized_reader_from_torch)
