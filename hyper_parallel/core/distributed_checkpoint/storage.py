"""Storage protocols (seed path ``distributed_checkpoint.storage``).

A face over :mod:`.backends.protocol`, where the call order of every method is documented, and
:mod:`.transfer.saver` for ``WriteResult`` (what a rank's writes produced: files and chunk records).
"""

from .backends.protocol import StorageReader, StorageWriter
from .transfer.saver import WriteResult

__all__ = ["StorageWriter", "StorageReader", "WriteResult"]
