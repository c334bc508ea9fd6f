"""torch DCP's ``format_utils`` import path: a checkpoint <-> one ``torch.save`` file.

A face over :mod:`.interop.torch_save`.
"""

from .interop.torch_save import (
    BroadcastingTorchSaveReader,
    DynamicMetaLoadPlanner,
    dcp_to_torch_save,
    torch_save_to_dcp,
)

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp", "BroadcastingTorchSaveReader", "DynamicMetaLoadPlanner"]
