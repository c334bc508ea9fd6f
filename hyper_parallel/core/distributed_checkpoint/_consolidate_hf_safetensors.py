"""torch DCP's ``_consolidate_hf_safetensors`` import path (private in torch; torchtitan and
other clients import it): sharded Hugging Face safetensors into whole-tensor files.

A face over :mod:`._src.interop.huggingface.consolidate`.
"""

from ._src.interop.huggingface.consolidate import (
    consolidate_safetensors_files,
    consolidate_safetensors_files_on_every_rank,
)

__all__ = ["consolidate_safetensors_files", "consolidate_safetensors_files_on_every_rank"]
