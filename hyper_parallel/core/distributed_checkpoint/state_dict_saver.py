"""torch DCP's ``state_dict_saver`` import path: ``save``, ``async_save``, the deprecated
``save_state_dict`` and the private ``_save_state_dict`` some clients import.

A face over :mod:`._src.engine.checkpoint`, :mod:`._src.asynchronous` and :mod:`._src.interop.torch.deprecated_calls`.
``AsyncCheckpointerType`` is torch's enum (configuration), which ``async_save`` takes.
"""

from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ._src.asynchronous.api import async_save
from ._src.asynchronous.response import AsyncSaveResponse
from ._src.engine.checkpoint import save
from ._src.interop.torch.deprecated_calls import _save_state_dict as _save_state_dict  # torch's private call form
from ._src.interop.torch.deprecated_calls import save_state_dict

__all__ = ["save", "async_save", "save_state_dict", "AsyncCheckpointerType", "AsyncSaveResponse"]
