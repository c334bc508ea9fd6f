"""torch DCP's ``state_dict_loader`` import path: ``load``, the deprecated ``load_state_dict`` and
the private ``_load_state_dict`` clients import (Lightning's consolidation, accelerate).

A face over :mod:`.engine.checkpoint` and :mod:`.interop.deprecated_calls`.
"""

from .engine.checkpoint import load
from .interop.deprecated_calls import _load_state_dict as _load_state_dict  # torch's private call form
from .interop.deprecated_calls import _load_state_dict_from_keys as _load_state_dict_from_keys  # torch's private
from .interop.deprecated_calls import load_state_dict

__all__ = ["load", "load_state_dict"]
