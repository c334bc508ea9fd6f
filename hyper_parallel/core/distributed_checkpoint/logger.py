"""torch DCP's ``logger`` import path: its module logger and the name of its DCP logger.

A face over torch's objects (logging configuration, nothing of a checkpoint's), including the
private ``_dcp_logger`` decorator torch's tests import from here.
"""

from torch.distributed.checkpoint.logger import DCP_LOGGER_NAME, logger
from torch.distributed.checkpoint.logger import _dcp_logger as _dcp_logger  # torch's private decorator

__all__ = ["logger", "DCP_LOGGER_NAME"]
