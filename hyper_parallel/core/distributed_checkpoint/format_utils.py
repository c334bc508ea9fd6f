"""torch DCP's ``format_utils`` import path: a checkpoint <-> one ``torch.save`` file.

A face over :mod:`._src.interop.torch.save_file`. Also, as torch's module has them (accelerate's
``merge_fsdp_weights`` and Lightning import them from here): ``_load_state_dict`` (a face over
:mod:`._src.interop.torch.deprecated_calls`) and ``_EmptyStateDictLoadPlanner``, torch's own planner, which
``load`` runs on torch's planner protocol (an empty target receives the whole checkpoint).
"""

from torch.distributed.checkpoint.default_planner import (
    _EmptyStateDictLoadPlanner as _EmptyStateDictLoadPlanner,  # torch's planner, run as torch's
)

from ._src.interop.torch.deprecated_calls import _load_state_dict as _load_state_dict  # torch's private call form
from ._src.interop.torch.save_file import (
    BroadcastingTorchSaveReader,
    DynamicMetaLoadPlanner,
    dcp_to_torch_save,
    torch_save_to_dcp,
)

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp", "BroadcastingTorchSaveReader", "DynamicMetaLoadPlanner"]
