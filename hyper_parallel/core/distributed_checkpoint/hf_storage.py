"""torch DCP's ``hf_storage`` import path: Hugging Face safetensors storage.

A face over :mod:`.interop.huggingface` (the reader).
"""

from .interop.huggingface import HuggingFaceStorageReader

__all__ = ["HuggingFaceStorageReader"]
