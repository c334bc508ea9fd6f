"""torch DCP's ``state_dict_loader`` import path: ``load``, the deprecated ``load_state_dict`` and
the private ``_load_state_dict`` clients import (Lightning's consolidation, accelerate).

A face over :mod:`._src.engine.checkpoint` and :mod:`._src.interop.torch.deprecated_calls`.
"""

from ._src.engine.checkpoint import load
from ._src.interop.torch.deprecated_calls import _load_state_dict as _load_state_dict  # torch's private call form
from ._src.interop.torch.deprecated_calls import (
    _load_state_dict_from_keys as _load_state_dict_from_keys,  # torch's private
)
from ._src.interop.torch.deprecated_calls import load_state_dict

__all__ = ["load", "load_state_dict"]
