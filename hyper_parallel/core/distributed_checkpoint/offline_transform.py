"""Offline transforms and conversions (seed path ``distributed_checkpoint.offline_transform``).

A face over :mod:`.resharding.offline_transform` and the format converters of :mod:`.interop`.
"""

from .interop.full_checkpoint import (
    convert_full_checkpoint_to_dcp,
    dcp_to_full_state_dict,
    full_state_dict_to_dcp_format,
)
from .interop.hf_export import save_state_dict_as_huggingface_format
from .interop.hf_import import parse_checkpoint_from_huggingface
from .interop.torch_dcp_import import import_torch_dcp
from .resharding.offline_transform import offline_transform

__all__ = [
    "offline_transform",
    "save_state_dict_as_huggingface_format",
    "parse_checkpoint_from_huggingface",
    "full_state_dict_to_dcp_format",
    "dcp_to_full_state_dict",
    "convert_full_checkpoint_to_dcp",
    "import_torch_dcp",
]
