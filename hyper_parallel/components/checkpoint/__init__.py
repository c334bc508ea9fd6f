"""Checkpointers, and Hugging Face weights loaded into a finalized, sharded model.

- :class:`HFLoadPlanner`, :func:`load_hf_checkpoint`: load a Hugging Face checkpoint with the
  model's conversion rules, each rank reading only the regions of the checkpoint its shards need
  (:mod:`.huggingface_load_planner`).
- :class:`HuggingFaceCheckpointer`: the same as a :class:`CheckpointerBase`, with the legacy
  whole-tensor loader (:mod:`.whole_tensor_loader`) as the other choice; both give equal values
  and an equal :class:`LoadReport`.
- The rules: :class:`WeightRenaming`, :class:`WeightConverter` and :class:`ConversionOps`
  (transformers' own where installed, :mod:`.weight_conversion`), and this package's conversion
  steps (:mod:`.conversion_ops`): :class:`AddScalar`, :class:`ConcatenateWithSections`,
  :class:`Split`, :class:`InterleaveQKV`, :class:`DeinterleaveQKV`, :class:`InterleaveGateQKV`,
  :class:`DeinterleaveGateQKV`.
"""

from .base import CheckpointerBase
from .conversion_ops import (
    AddScalar,
    ConcatenateWithSections,
    DeinterleaveGateQKV,
    DeinterleaveQKV,
    InterleaveGateQKV,
    InterleaveQKV,
    Split,
)
from .huggingface_checkpointer import HuggingFaceCheckpointer, resolve_hf_loader
from .huggingface_load_planner import HFLoadPlanner, load_hf_checkpoint
from .load_report import LoadReport, MissingWeightsError
from .weight_conversion import ConversionOps, WeightConverter, WeightRenaming

__all__ = [
    "AddScalar",
    "CheckpointerBase",
    "ConcatenateWithSections",
    "ConversionOps",
    "DeinterleaveGateQKV",
    "DeinterleaveQKV",
    "HFLoadPlanner",
    "HuggingFaceCheckpointer",
    "InterleaveGateQKV",
    "InterleaveQKV",
    "LoadReport",
    "MissingWeightsError",
    "Split",
    "WeightConverter",
    "WeightRenaming",
    "load_hf_checkpoint",
    "resolve_hf_loader",
]
