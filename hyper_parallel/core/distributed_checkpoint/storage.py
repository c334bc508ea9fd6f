"""Storage protocols (seed path ``distributed_checkpoint.storage``).

A face over :mod:`.backends.protocol`, where the call order of every method is documented.
"""

from .backends.protocol import StorageReader, StorageWriter

__all__ = ["StorageWriter", "StorageReader"]
