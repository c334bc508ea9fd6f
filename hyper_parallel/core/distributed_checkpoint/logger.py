"""torch DCP's ``logger`` import path: its module logger and the name of its DCP logger.

A face over torch's objects (logging configuration, nothing of a checkpoint's).
"""

from torch.distributed.checkpoint.logger import DCP_LOGGER_NAME, logger

__all__ = ["logger", "DCP_LOGGER_NAME"]
