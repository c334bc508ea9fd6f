"""torch DCP's ``state_dict_loader`` import path: ``load`` and the deprecated ``load_state_dict``.

A face over :mod:`.engine.checkpoint` and :mod:`.interop.deprecated_calls`.
"""

from .engine.checkpoint import load
from .interop.deprecated_calls import load_state_dict

__all__ = ["load", "load_state_dict"]
