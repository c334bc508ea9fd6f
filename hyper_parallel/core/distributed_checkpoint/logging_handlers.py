"""torch DCP's ``logging_handlers`` import path: the DCP logger's name (torch's).

A face over torch's module, whose import registers the DCP logger's handler.
"""

from torch.distributed.checkpoint.logging_handlers import DCP_LOGGER_NAME

__all__ = ["DCP_LOGGER_NAME"]
