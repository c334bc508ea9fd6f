"""Local and shared filesystem storage (seed path ``distributed_checkpoint.filesystem_storage``).

A face over :mod:`.backends.filesystem`.
"""

from .backends.filesystem import FileSystemReader, FileSystemWriter

__all__ = ["FileSystemWriter", "FileSystemReader"]
