"""Offline transforms and conversions (HyperParallel's path ``distributed_checkpoint.offline_transform``).

A face over :mod:`._src.resharding.offline_transform` and the format converters of :mod:`._src.interop`.
"""

from ._src.interop.huggingface.exporting import save_state_dict_as_huggingface_format
from ._src.interop.huggingface.importing import parse_checkpoint_from_huggingface
from ._src.interop.torch.full_checkpoint import (
    convert_full_checkpoint_to_dcp,
    dcp_to_full_state_dict,
    full_state_dict_to_dcp_format,
)
from ._src.interop.torch.importing import import_torch_dcp
from ._src.resharding.offline_transform import offline_transform

__all__ = [
    "offline_transform",
    "save_state_dict_as_huggingface_format",
    "parse_checkpoint_from_huggingface",
    "full_state_dict_to_dcp_format",
    "dcp_to_full_state_dict",
    "convert_full_checkpoint_to_dcp",
    "import_torch_dcp",
]
