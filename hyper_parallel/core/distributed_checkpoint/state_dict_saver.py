"""torch DCP's ``state_dict_saver`` import path: ``save``, ``async_save``, the deprecated
``save_state_dict`` and the private ``_save_state_dict`` some clients import.

A face over :mod:`.engine.checkpoint`, :mod:`.asynchronous` and :mod:`.interop.deprecated_calls`.
``AsyncCheckpointerType`` is torch's enum (configuration), which ``async_save`` takes.
"""

from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from .asynchronous.api import async_save
from .asynchronous.response import AsyncSaveResponse
from .engine.checkpoint import save
from .interop.deprecated_calls import _save_state_dict as _save_state_dict  # torch's private call form
from .interop.deprecated_calls import save_state_dict

__all__ = ["save", "async_save", "save_state_dict", "AsyncCheckpointerType", "AsyncSaveResponse"]
