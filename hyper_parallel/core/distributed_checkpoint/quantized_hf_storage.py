"""FP8 block-quantized Hugging Face checkpoints (torch path
``torch.distributed.checkpoint.quantized_hf_storage``).

A face over :mod:`._src.interop.huggingface.quantized`.
"""

from ._src.interop.huggingface.quantized import QuantizedHuggingFaceStorageReader

__all__ = ["QuantizedHuggingFaceStorageReader"]
