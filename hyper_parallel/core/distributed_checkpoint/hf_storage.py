"""Hugging Face safetensors storage (torch's module name ``torch.distributed.checkpoint.hf_storage``).

A face over :mod:`.interop.hf_writer` (save straight to safetensors, consolidated or in
torch's sharded format) and :mod:`.interop.huggingface` (load and reshard from them).
"""

from .interop.hf_writer import HuggingFaceStorageWriter
from .interop.huggingface import HuggingFaceStorageReader

__all__ = ["HuggingFaceStorageWriter", "HuggingFaceStorageReader"]
