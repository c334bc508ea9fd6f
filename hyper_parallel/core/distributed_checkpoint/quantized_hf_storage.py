"""FP8 block-quantized Hugging Face checkpoints (torch path
``torch.distributed.checkpoint.quantized_hf_storage``).

A face over :mod:`.interop.quantized_hf`.
"""

from .interop.quantized_hf import QuantizedHuggingFaceStorageReader

__all__ = ["QuantizedHuggingFaceStorageReader"]
